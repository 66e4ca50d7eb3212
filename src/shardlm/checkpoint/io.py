"""Reading DCP checkpoints without running foreign code, and refusing broken ones by name.

torch 2.13's ``FileSystemReader.read_metadata`` reads ``.metadata`` with plain ``pickle.load`` and
``DefaultLoadPlanner.load_bytes`` uses ``torch.load(weights_only=False)``; only tensor chunks use
``weights_only=True``. ``SafeReader`` and ``SafeLoadPlanner`` replace both with restricted
unpicklers, so reading a checkpoint never runs arbitrary code; ``read_metadata`` checks that every
shard file it names is there and whole before anything is read.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardlm.distributed.shards import LoadPlanner
from shardlm.errors import ConfigError

_SAFE_MODULES = {  # module -> the globals a DCP .metadata pickle may name (seen in torch 2.13 files)
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "StorageMeta",
        "MetadataIndex",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``Metadata`` only: DCP's own dataclasses, torch.Size and dtypes, paths."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _SAFE_MODULES.get(module, ()):  # exact names only: no dotted paths into a module
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
        except FileNotFoundError:
            raise ConfigError(f"checkpoint '{self.path}': '{path}' is missing; the checkpoint is incomplete") from None
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a damaged or foreign file
            raise ConfigError(f"checkpoint '{self.path}': '{path}' is damaged or not DCP metadata ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"checkpoint '{self.path}': '{path}' is not DCP metadata")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(LoadPlanner):
    """DCP's default load planner (``shards.LoadPlanner``: packed DTensors in place) that reads
    non-tensor items (optimizer hyper-parameters) with ``torch.load(weights_only=True)`` instead
    of full unpickling."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(step_dir: str) -> Metadata:
    """DCP metadata of ``step_dir`` (safely), after checking every shard file it names is whole."""
    metadata = SafeReader(step_dir).read_metadata()
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            raise ConfigError(f"checkpoint '{step_dir}': shard file '{path}' is missing")
        have = os.path.getsize(path)
        if have < size:
            raise ConfigError(f"checkpoint '{step_dir}': shard file '{path}' is truncated ({have} of {size} bytes)")
    return metadata


def load_dcp(state: dict, step_dir: str, no_dist: bool = False) -> None:
    """``dcp.load`` with the safe reader and planner; read errors become one-line ConfigErrors."""
    try:
        with warnings.catch_warnings():  # one-process reads (consolidate) are intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(step_dir), planner=SafeLoadPlanner(), no_dist=no_dist)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - DCP wraps per-rank failures; keep the first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"checkpoint '{step_dir}' could not be read: {first}") from None
