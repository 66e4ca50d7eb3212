"""Resumable sharded checkpoints: DCP shards of model + optimizer, and the rest of the run state.

``OUTPUT_DIR/checkpoints/step-N/`` holds
  * ``.metadata`` + ``__R_0.distcp``: DCP shards of ``{"model": ..., "optim": ...}`` keyed by
    parameter FQN (``get_state_dict``), so any layout can load them (DCP reshards DTensors).
    Each rank writes and reads only its own boxes, a packed projection's parts included
    (``shards.py``): no tensor is gathered whole to save or load it;
  * ``rng/rankR.safetensors``: each rank's torch RNG states;
  * ``hf/``: the model's config.json, generation_config.json and tokenizer files, for consolidation;
  * ``shardlm_checkpoint.json`` (the marker, written last): step (= data position, the order being
    f(seed, global batch)), global batch, seed, scheduler state, layout, the resolved config.
Every rank writes into ``step-N.tmp-<id>``; after a barrier rank 0 writes the marker and renames
the directory, so a crash mid-save never leaves a directory that looks whole.

Safety: torch 2.13's ``FileSystemReader.read_metadata`` reads ``.metadata`` with plain
``pickle.load`` and ``DefaultLoadPlanner.load_bytes`` uses ``torch.load(weights_only=False)``;
only tensor chunks use ``weights_only=True``. ``SafeReader`` and ``SafeLoadPlanner`` below
replace both with restricted unpicklers, so reading a checkpoint never runs arbitrary code.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardlm.errors import ConfigError
from shardlm.shards import LoadPlanner, PackedShards, SavePlanner, packed_view

log = logging.getLogger("shardlm")

MARKER = "shardlm_checkpoint.json"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d+)$")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# LoRA runs save only what trains (adapters, modules_to_save) and its optimizer state; the frozen
# base is re-read from the base model on resume
LORA_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)
HF_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
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


# ---------------------------------------------------------------- finding checkpoints


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def read_marker(step_dir: str) -> dict:
    """The marker of a complete checkpoint; a ConfigError naming the directory otherwise."""
    if ".tmp-" in os.path.basename(os.path.normpath(step_dir)):
        raise ConfigError(f"checkpoint '{step_dir}' is an unfinished save (a .tmp- directory); use a complete step-N")
    path = os.path.join(step_dir, MARKER)
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint '{step_dir}' has no {MARKER}: the save did not finish; use an earlier step-N")
    try:
        with open(path) as fh:
            marker = json.load(fh)
    except (OSError, ValueError):
        raise ConfigError(f"checkpoint '{step_dir}': {MARKER} is damaged; use an earlier step-N") from None
    if marker.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint '{step_dir}': {MARKER} has format {marker.get('format')}, expected 1")
    return marker


def find_latest(output_dir: str) -> str | None:
    """Newest complete ``step-N`` under ``output_dir/checkpoints`` (incomplete saves are skipped)."""
    root = checkpoints_dir(output_dir)
    steps = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, MARKER)):
            steps.append((int(match.group(1)), os.path.join(root, name)))
    return max(steps)[1] if steps else None


def resolve(path: str, key: str = "checkpoint") -> str:
    """A step directory from a step directory or an output directory (its newest complete step)."""
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: '{path}' is not a directory; pass a checkpoint step-N or an output_dir")
    if os.path.isfile(os.path.join(path, MARKER)) or STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        read_marker(path)
        return path
    if ".tmp-" in os.path.basename(os.path.normpath(path)):
        read_marker(path)  # raises: unfinished save
    latest = find_latest(path)
    if latest is None:
        raise ConfigError(f"{key}: '{path}' has no complete checkpoint under checkpoints/step-N")
    return latest


# ---------------------------------------------------------------- saving


def should_save(step: int, save_steps: int, max_steps: int) -> bool:
    """Every ``save_steps`` and at the last step; ``save_steps: 0`` turns checkpointing off."""
    return save_steps > 0 and (step % save_steps == 0 or step == max_steps)


def _broadcast_str(value: str) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _copy_hf_files(cfg, dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    sources = [(cfg.model, HF_FILES), (cfg.tokenizer or cfg.model, TOKENIZER_FILES)]
    for folder, names in sources:
        for name in names:
            if os.path.isfile(os.path.join(folder, name)):
                shutil.copy2(os.path.join(folder, name), os.path.join(dest, name))
    from shardlm.published import record_layout

    record_layout(cfg.model, dest)  # the published layout the weights were read in, for consolidation


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)  # so the rename itself survives a power cut (POSIX)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finalize(tmp: str, final: str, marker: dict) -> None:
    """Rank 0, after every rank wrote its shards: marker last, then the atomic rename."""
    with open(os.path.join(tmp, MARKER + ".part"), "w") as fh:
        json.dump(marker, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(os.path.join(tmp, MARKER + ".part"), os.path.join(tmp, MARKER))
    if os.path.exists(final):  # re-saving a step that exists (resumed from an older one)
        old = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


def prune(output_dir: str, keep: int | None, current: str) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop leftovers of interrupted saves."""
    root = checkpoints_dir(output_dir)
    complete = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if ".tmp-" in name or ".old-" in name:
            if path != current:
                log.info("removing %s, left by an interrupted save", path)
                shutil.rmtree(path, ignore_errors=True)
        elif STEP_DIR.match(name) and os.path.isfile(os.path.join(path, MARKER)):
            complete.append((int(STEP_DIR.match(name).group(1)), path))
    if keep is not None:
        for _, path in sorted(complete)[: max(0, len(complete) - keep)]:
            log.info("removing %s (train.save_total_limit=%d)", path, keep)
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(trainer) -> str:
    """Collective: every rank writes its shards of model, optimizer and RNG into one step dir."""
    cfg, t = trainer.config, trainer.config.train
    rank, start = dist.get_rank(), time.perf_counter()
    final = os.path.join(checkpoints_dir(t.output_dir), f"step-{trainer.step}")
    tmp = _broadcast_str(f"{final}.tmp-{uuid.uuid4().hex[:8]}" if rank == 0 else "")
    if rank == 0:
        os.makedirs(os.path.join(tmp, "rng"))
        _copy_hf_files(cfg, os.path.join(tmp, "hf"))
    dist.barrier()
    model_sd, optim_sd = _state_dicts(trainer)
    state = {"model": packed_view(model_sd), "optim": packed_view(optim_sd)}
    dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=SavePlanner())
    from safetensors.torch import save_file

    save_file(_rng_state(), os.path.join(tmp, "rng", f"rank{rank}.safetensors"))
    dist.barrier()
    if rank == 0:
        marker = {
            "format": FORMAT_VERSION,
            "step": trainer.step,
            "samples_seen": trainer.step * cfg.global_batch_size,
            "global_batch_size": cfg.global_batch_size,
            "seed": t.seed,
            "num_samples": len(trainer.dataset),
            "world_size": dist.get_world_size(),
            "layout": {"tp": cfg.parallel.tp, "fsdp": cfg.parallel.fsdp, "dp_replicate": cfg.parallel.dp_replicate},
            "lora": lora_marker(trainer.model),
            "scheduler": trainer.scheduler.state_dict(),
            "config": cfg.to_dict(),
        }
        _finalize(tmp, final, marker)
        prune(t.output_dir, t.save_total_limit, final)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(final) for f in fs)
        print(f"saved {final} ({size / 1e6:.1f} MB in {time.perf_counter() - start:.2f} s)", flush=True)
    dist.barrier()
    return final


# ---------------------------------------------------------------- resuming


def check_compatible(step_dir: str, marker: dict, cfg, num_samples: int | None = None) -> None:
    """Refuse a resume that would silently change the data order (global batch, seed, data)."""
    if marker["global_batch_size"] != cfg.global_batch_size:
        raise ConfigError(
            f"train.resume: '{step_dir}' was trained with global batch {marker['global_batch_size']} but this run has "
            f"{cfg.global_batch_size} (per_device_train_batch_size x dp x gradient_accumulation_steps); make them equal"
        )
    if marker["seed"] != cfg.train.seed:
        raise ConfigError(f"train.seed: {cfg.train.seed} differs from the checkpoint's {marker['seed']}; set it back")
    if num_samples is not None and marker["num_samples"] != num_samples:
        raise ConfigError(
            f"data.path: the dataset has {num_samples} samples but '{step_dir}' was trained on "
            f"{marker['num_samples']}; the data order would change, resume with the same data"
        )


def precheck_resume(cfg) -> None:
    """Before spawning: the checkpoint ``train.resume`` names exists, is complete and fits this run."""
    t = cfg.train
    if t.resume is False or t.resume is None:
        return
    step_dir = find_latest(t.output_dir) if t.resume is True else resolve(str(t.resume), "train.resume")
    if step_dir is not None:
        check_compatible(step_dir, read_marker(step_dir), cfg)


def _check_shapes(step_dir: str, metadata: Metadata, model_sd: dict) -> None:
    """Every model tensor must exist in the checkpoint with the same global shape."""
    saved = metadata.state_dict_metadata
    for name, tensor in model_sd.items():
        item = saved.get(f"model.{name}")
        if not isinstance(item, TensorStorageMetadata):
            raise ConfigError(f"train.resume: '{step_dir}' has no weight '{name}'; it was saved from another model")
        if tuple(item.size) != tuple(tensor.shape):
            raise ConfigError(
                f"train.resume: '{step_dir}' holds '{name}' as {list(item.size)} but 'model' has "
                f"{list(tensor.shape)}; it was saved from another model"
            )


def _restore_rng(step_dir: str, saved_world: int) -> None:
    from safetensors.torch import load_file

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != saved_world and rank == 0:
        log.info(
            "checkpoint saved by %d ranks, resuming on %d: rank r takes RNG of rank r %% %d",
            saved_world,
            world,
            saved_world,
        )
    path = os.path.join(step_dir, "rng", f"rank{rank % saved_world}.safetensors")
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint '{step_dir}': '{path}' is missing")
    state = load_file(path)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _options(trainer) -> StateDictOptions:
    return LORA_OPTIONS if getattr(trainer.model, "shardlm_lora", None) is not None else OPTIONS


def _state_dicts(trainer) -> tuple[dict, dict]:
    """Model and optimizer state to save or fill. In a LoRA run only what trains: torch's
    ``ignore_frozen_params`` misses the second name of a tied frozen weight (GPT-2's lm_head)."""
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_options(trainer))
    if getattr(trainer.model, "shardlm_lora", None) is not None:
        trains = {n for n, p in trainer.model.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trains}
    return model_sd, optim_sd


def lora_marker(model) -> dict | None:
    """What the marker records of a LoRA run: the peft config (``consolidate`` writes it out)."""
    cfg = getattr(model, "shardlm_lora", None)
    return None if cfg is None else json.loads(json.dumps(cfg.to_dict(), default=list))


def _check_lora(step_dir: str, marker: dict, trainer) -> None:
    """A LoRA checkpoint resumes only a LoRA run with the same adapter shapes, and vice versa."""
    saved, mine = marker.get("lora"), lora_marker(trainer.model)
    if bool(saved) != bool(mine):
        what = "a LoRA run" if saved else "a full fine-tuning run"
        fix = "add the same 'lora' section" if saved else "remove the 'lora' section"
        raise ConfigError(f"train.resume: '{step_dir}' is from {what}; {fix} to resume it")
    if saved:
        for key in ("r", "lora_alpha", "target_modules", "modules_to_save"):
            a, b = saved.get(key), mine.get(key)
            if (sorted(a) if isinstance(a, list) else a) != (sorted(b) if isinstance(b, list) else b):
                raise ConfigError(f"lora: {key} is {b!r} but '{step_dir}' was trained with {a!r}; set it back")


def load_checkpoint(trainer, step_dir: str) -> dict:
    """Collective: restore model, optimizer, scheduler, RNG and step from ``step_dir``, any layout."""
    marker = read_marker(step_dir)
    check_compatible(step_dir, marker, trainer.config, len(trainer.dataset))
    _check_lora(step_dir, marker, trainer)
    metadata = read_metadata(step_dir)
    model_sd, optim_sd = _state_dicts(trainer)
    _check_shapes(step_dir, metadata, model_sd)
    state = {"model": packed_view(model_sd), "optim": packed_view(optim_sd)}
    load_dcp(state, step_dir)  # tensors in place; non-tensor entries (lr, betas) replaced in ``state``
    for section, loaded in (("model", model_sd), ("optim", optim_sd)):
        for key, value in state[section].items():
            if not isinstance(value, PackedShards):
                loaded[key] = value
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=_options(trainer),
    )
    trainer.scheduler.load_state_dict(marker["scheduler"])
    trainer.scheduler.last_epoch -= 1  # recompute this step's lr: same value, or the new schedule's
    trainer.scheduler.step()  # if train.max_steps changed on resume
    _restore_rng(step_dir, marker["world_size"])
    trainer.step = marker["step"]
    return marker


def maybe_resume(trainer) -> str | None:
    """Apply ``train.resume``: ``true`` -> newest complete checkpoint of output_dir (none: start
    fresh), a path -> that checkpoint. Returns the step dir resumed from, or None."""
    t = trainer.config.train
    if t.resume is False or t.resume is None:
        return None
    if t.resume is True:
        found = find_latest(t.output_dir) if dist.get_rank() == 0 else None
        step_dir = _broadcast_str(found or "") or None
        if step_dir is None:
            if dist.get_rank() == 0:
                print(f"resume: no complete checkpoint in {checkpoints_dir(t.output_dir)}; starting fresh", flush=True)
            return None
    else:
        step_dir = resolve(str(t.resume), "train.resume")
    marker = load_checkpoint(trainer, step_dir)
    if dist.get_rank() == 0:
        saved = ", ".join(f"{k}={v}" for k, v in marker["layout"].items())
        print(f"resumed from {step_dir} at step {marker['step']} (saved with {saved})", flush=True)
    return step_dir
