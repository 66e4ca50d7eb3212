"""Which global rows and columns a rank's local piece of a DTensor holds, and DCP access to it.

One rule, used for init, HF loading and checkpoints alike: placements apply right to left, TP
first, then FSDP2's chunking of the TP-local tensor (how FSDP2 shards a TP DTensor). On the TP
mesh dim a ``_StridedShard`` is a packed projection (``tp.PackedColwiseParallel``): each of
its parts is chunked on its own, so rank r holds rows ``[q_r; k_r; v_r]``.

Every local piece is one box of the global tensor except a packed projection's, which is P boxes
(one per part). DCP addresses a DTensor shard as one box (FSDP-over-TP ``_StridedShard`` on the
FSDP dim included: torch's ``compute_local_shape_and_global_offset`` gets those right), so
``PackedShards`` presents a packed DTensor to DCP as its P boxes, views of the local tensor: it
is saved and loaded in place, by every rank at once, and never gathered whole (what the earlier
``full_tensor()`` on every save did, per parameter and per optimizer state).

``LocalParams``: a module's DTensor parameters seen as their local tensors while it runs (the
styles that run a module's own forward on local pieces: ``replicate_local``, ``per_channel``,
``experts``).
"""

from __future__ import annotations

from itertools import product

import torch
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


def _tp_strided(param: DTensor, mesh_dim: int) -> _StridedShard | None:
    placement = param.placements[mesh_dim]
    is_tp = param.device_mesh.mesh_dim_names[mesh_dim] == "tp"
    return placement if is_tp and isinstance(placement, _StridedShard) else None


def is_packed(param: torch.Tensor) -> bool:
    """A packed projection's parameter (or its optimizer state): ``_StridedShard`` on the TP dim."""
    return isinstance(param, DTensor) and any(_tp_strided(param, d) for d in range(param.device_mesh.ndim))


def local_index(param: torch.Tensor, dim: int) -> torch.Tensor:
    """Global positions along ``dim`` of this rank's local piece of ``param``, in local order."""
    index = torch.arange(param.shape[dim])
    if not isinstance(param, DTensor):
        return index
    mesh = param.device_mesh
    for mesh_dim in reversed(range(mesh.ndim)):
        placement, n, coord = param.placements[mesh_dim], mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        strided = isinstance(placement, _StridedShard)  # not a Shard subclass in torch 2.13
        if not (strided or placement.is_shard()) or placement.dim % param.ndim != dim:
            continue
        if _tp_strided(param, mesh_dim):
            index = torch.cat([part.chunk(n)[coord] for part in index.chunk(placement.split_factor)])
        else:
            chunks = index.chunk(n)
            index = chunks[coord] if coord < len(chunks) else index[:0]
    return index


def local_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` for ``param``, without communication."""
    if not isinstance(param, DTensor):
        return full
    piece = full
    for dim in range(full.ndim):
        index = local_index(param, dim)
        if len(index) != full.shape[dim]:
            piece = piece.index_select(dim, index)
    return piece


@torch.no_grad()
def fill_from_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's piece of ``full`` into ``param`` (any placements; no communication)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    local.copy_(local_piece(param, full.to(local.dtype)))


def full_tensor(param: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
    """Collective over every rank: the whole of ``value`` (default ``param`` itself; or its
    gradient, or an optimizer state laid out like it), assembled by this module's rule.

    Use it instead of ``DTensor.full_tensor()`` on shardlm's parameters: for a packed projection
    under FSDP (``_StridedShard`` on tp, FSDP's chunking of the TP-local tensor above it) torch
    2.13's ``full_tensor()`` does not put the rows where this rule (which training, checkpoints
    and consolidation use) says they are: Phi-3's gate_up lora_B came back permuted. Each rank
    writes its boxes into a zero tensor and every rank sums them; positions held by several
    ranks (replicas) are divided by their count. Whole-size memory and an all-reduce per call:
    for tests and inspection, not for saves (those go through ``PackedShards``).
    """
    import torch.distributed as dist

    value = param if value is None else value
    if not isinstance(param, DTensor):
        return value.detach().clone()
    local = value.to_local() if isinstance(value, DTensor) else value
    where = torch.meshgrid(*(local_index(param, d) for d in range(param.ndim)), indexing="ij")
    full = torch.zeros(param.shape, dtype=local.dtype, device=local.device)
    copies = torch.zeros(param.shape, dtype=local.dtype, device=local.device)
    full[where], copies[where] = local.detach(), 1.0
    dist.all_reduce(full)
    dist.all_reduce(copies)
    return full / copies


def index_runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """``index`` as maximal runs of consecutive positions: (local start, global start, length)."""
    runs: list[tuple[int, int, int]] = []
    for local, position in enumerate(index.tolist()):
        if runs and runs[-1][1] + runs[-1][2] == position:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((local, position, 1))
    return runs


class PackedShards:
    """A packed DTensor as DCP sees it: its local tensor cut into the global boxes it holds.

    Implements DCP's ``_Checkpointable`` protocol (write items, chunk list, shard lookup) plus
    ``size()``; the planners below route DCP's object lookup here. Each box is a view, so a load
    writes straight into the parameter or optimizer state.
    """

    def __init__(self, param: DTensor):
        self.local = param.to_local()
        self.global_size = param.shape
        self.boxes: list[tuple[torch.Size, torch.Tensor]] = []  # (global offsets, view of local)
        per_dim = [index_runs(local_index(param, d)) for d in range(param.ndim)]
        for runs in product(*per_dim):
            view = self.local
            for dim, (start, _, length) in enumerate(runs):
                view = view.narrow(dim, start, length)
            self.boxes.append((torch.Size(r[1] for r in runs), view))

    def size(self) -> torch.Size:
        return self.global_size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.shape) for offsets, view in self.boxes]

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                    properties=properties,
                    size=self.global_size,
                ),
            )
            for offsets, view in self.boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self.boxes:
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: no local box at {index.offset}")


def packed_view(state: dict) -> dict:
    """``state`` with every packed DTensor presented as its ``PackedShards`` (others unchanged)."""
    return {k: PackedShards(v) if is_packed(v) else v for k, v in state.items()}


def _lookup(state_dict: dict, index: MetadataIndex):
    """DCP's ``find_state_dict_object``, for state dicts that may hold ``PackedShards`` (DCP looks
    objects up by ``isinstance(obj, Tensor)``, which a wrapper is not)."""
    obj = state_dict.get(index.fqn)
    if isinstance(obj, PackedShards):
        return obj.__get_tensor_shard__(index)
    return find_state_dict_object(state_dict, index)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, for state dicts made by ``packed_view``."""

    def lookup_object(self, index: MetadataIndex):
        return _lookup(self.state_dict, index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, for state dicts made by ``packed_view`` (loads in place).

    DCP's set-up first runs ``_init_state_dict`` (it materializes meta tensors, which these state
    dicts never hold) and that replaces every object it does not know by None; the packed
    entries are hidden from it behind their local tensors and put back afterwards.
    """

    def set_up_planner(self, state_dict: dict, metadata=None, is_coordinator: bool = False) -> None:
        packed: dict[tuple, PackedShards] = {}

        def hide(d: dict, path: tuple) -> None:
            for key, value in d.items():
                if isinstance(value, dict):
                    hide(value, (*path, key))
                elif isinstance(value, PackedShards):
                    packed[(*path, key)] = value
                    d[key] = value.local

        hide(state_dict, ())
        super().set_up_planner(state_dict, metadata, is_coordinator)
        flat_key = {tuple(path): key for key, path in getattr(self, "mappings", {}).items()}
        for path, value in packed.items():
            parent = state_dict
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = value
            self.state_dict[flat_key.get(path, path[-1])] = value

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)


def as_local(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (a loss, a norm) as the plain tensor every rank holds."""
    return value.to_local() if isinstance(value, DTensor) else value


class LocalParams:
    """Plain tensors in place of a module's DTensor parameters while it runs: ``swap`` puts a local
    tensor in (any submodule's parameter), ``restore`` puts every parameter back. Styles call both
    from the module's own forward hooks, so FSDP2 (which unshards a whole block before) and
    activation checkpointing (which reruns the module) see their parameters as they left them."""

    def __init__(self):
        self.saved: list[tuple[nn.Module, str, torch.Tensor]] = []

    def swap(self, sub: nn.Module, name: str, local: torch.Tensor) -> None:
        self.saved.append((sub, name, sub._parameters[name]))
        sub._parameters[name] = local

    def restore(self) -> None:
        while self.saved:
            sub, name, param = self.saved.pop()
            sub._parameters[name] = param
