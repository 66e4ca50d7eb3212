"""Which global rows and columns a rank's local piece of a DTensor holds, and DCP access to it.

One rule, used for init, HF loading and checkpoints alike: placements apply right to left, TP
first, then FSDP2's chunking of the TP-local tensor (how FSDP2 shards a TP DTensor). On the TP
mesh dim a ``_StridedShard`` (P equal parts) or a ``PartsShard`` (parts of any sizes) is a packed
projection (``linear.PackedColwiseParallel``) or what acts on its channels: each of its parts is
chunked on its own, so rank r holds rows ``[q_r; k_r; v_r]``. ``packed_placement`` picks one. A
``RowsShard`` gives each rank the rows it computes, of any number (``linear.Colwise`` of ``Plan.stored_rows``).

Every local piece is one box of the global tensor except a packed projection's, which is P boxes
(one per part), and a ``RowsShard``'s, one per range (none where the rank holds no row). DCP
addresses a DTensor shard as one box (FSDP-over-TP ``_StridedShard`` on the FSDP dim included:
torch's ``compute_local_shape_and_global_offset`` gets those right), so ``PackedShards`` presents
such a DTensor to DCP as its boxes, views of the local tensor: it is saved and loaded in place, by
every rank at once, and never gathered whole (what the earlier ``full_tensor()`` on every save
did, per parameter and per optimizer state).

``LocalParams``: a module's DTensor parameters seen as their local tensors while it runs (the
styles that run a module's own forward on local pieces: ``replicate_local``, ``per_channel``,
``experts``); ``local_view``: the local piece of a parameter to compute on, what the TP styles read.
"""

from __future__ import annotations

import copy
import dataclasses
from itertools import product

import torch
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.distributed.tensor.placement_types import Placement, _StridedShard


class PartsShard(Shard):
    """``Shard(dim)`` of a dim made of unequal ``parts``, each chunked over TP on its own: rank r
    holds chunk r of every part, in order (Qwen3.5's ``in_proj_qkv``, q|k|v of key, key and value
    widths; Mamba-2's ``in_proj``, [z, x, B, C, dt]). What ``_StridedShard(dim, split_factor=P)``
    is for P equal parts, which is all it can express.

    To DTensor and FSDP2 it is ``Shard(dim)`` (it compares equal to it: shapes, sharding
    propagation and FSDP's chunking of the TP-local tensor are the same); only which global rows
    the local piece holds differs, and every place that asks reads ``local_index``.

    The price of that equality: DTensor caches sharding propagation per process, keyed by the input
    specs, and its C++ fast-path cache finds an entry by hash bucket and equality (``NativeOpSchema``'s
    ``==`` does not compare hashes). So an op on a tensor of the same mesh, shape and dtype can be
    answered with the output spec of an earlier op on the other kind, in both directions: a
    ``Shard(dim)`` tensor's ``detach`` (``nn.Parameter``, ``state_dict``), ``zeros_like`` (AdamW's
    states) or in-place op comes back ``PartsShard`` with another tensor's parts (Qwen3.5's in_proj_qkv.lora_B [128, 4]
    gave Kimi-Linear's gate_proj.lora_B its parts (32, 32, 64)), and a ``PartsShard`` one comes
    back a plain ``Shard``. Whether two specs share a bucket depends on their hashes, which differ
    per process (the mesh hashes its thread id): it happens on one rank and not the other, which
    DCP then refuses as overlapping chunks. The values are right, the positions are wrong; so
    shardlm records the placement each style gave a parameter (``parameter``, ``tp_placements``)
    and puts it back (``keep_placement``) wherever positions are read: on the parameters once built
    (``keep_placements``) and on the state dicts of a checkpoint (``keep_placements_in``).
    ``DTensor.full_tensor()`` gives the rows in rank order: use ``shards.full_tensor``.
    """

    def __init__(self, dim: int, parts: tuple[int, ...]):
        super().__init__(dim)
        self.parts = tuple(parts)

    def __hash__(self) -> int:  # not one entry with Shard(dim) in DTensor's Python-level propagation cache
        return hash((self.dim, self.parts))  # (its C++ one compares a bucket by ==: ``keep_placement``)

    def __repr__(self) -> str:
        return f"PartsShard(dim={self.dim}, parts={self.parts})"


class RowsShard(Shard):
    """``Shard(dim)`` where rank r holds the global rows ``rows[r]`` (ranges ``(start, stop)``, in
    order), as many as it computes, none at all included: Zaya's value ``cat(v_proj_current,
    v_proj_delayed)`` viewed into kv heads (``infer/joined_heads.py``) gives rank 0 at tp=2 all of
    ``v_proj_current`` and none of ``v_proj_delayed``, which no chunking of either expresses.

    Like ``PartsShard`` it compares equal to ``Shard(dim)`` (same caveats, same ``keep_placement``),
    but its local pieces are of unequal sizes: what holds them needs no shape from the placement
    (the styles compute on the local tensors, FSDP2 chunks the TP-local tensor it is given, clipping
    and the optimizer act on local pieces); every place that asks which rows a rank holds reads
    ``local_index``, and DCP sees its boxes (``PackedShards``), not torch's chunk arithmetic."""

    def __init__(self, dim: int, rows: tuple[tuple[tuple[int, int], ...], ...]):
        super().__init__(dim)
        self.rows = tuple(tuple((int(a), int(b)) for a, b in rank) for rank in rows)

    def __hash__(self) -> int:  # as ``PartsShard.__hash__``
        return hash((self.dim, self.rows))

    def __repr__(self) -> str:
        return f"RowsShard(dim={self.dim}, rows={self.rows})"

    def local_rows(self, index: torch.Tensor, coord: int) -> torch.Tensor:
        """Rank ``coord``'s entries of ``index`` (positions along the dim)."""
        return torch.cat([index[a:b] for a, b in self.rows[coord]])


def packed_placement(dim: int, parts: list[int] | tuple[int, ...]) -> Placement:
    """The TP placement of a ``dim`` made of ``parts`` (sizes), each split over TP on its own."""
    if len(parts) == 1:
        return Shard(dim)
    if len(set(parts)) == 1:
        return _StridedShard(dim, split_factor=len(parts))
    return PartsShard(dim, tuple(parts))


def _distribute(tensor: torch.Tensor, mesh: DeviceMesh, placement: Placement, src: int | None) -> DTensor:
    """``distribute_tensor`` on a 1-D mesh, ``PartsShard`` and ``RowsShard`` included (torch's own turns
    them into a plain ``Shard``): each rank cuts its rows from its own copy (no scatter;
    shardlm builds parameters on meta and fills them after, ``fill_from_full``)."""
    n, coord, dim = mesh.size(), mesh.get_local_rank(), getattr(placement, "dim", 0)
    if isinstance(placement, RowsShard):
        local = torch.cat([tensor.detach().narrow(dim, a, b - a) for a, b in placement.rows[coord]], dim)
    elif isinstance(placement, PartsShard):
        local = torch.cat([part.chunk(n, dim)[coord] for part in tensor.detach().split(placement.parts, dim)], dim)
    else:
        return distribute_tensor(tensor, mesh, [placement], src_data_rank=src)
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=tensor.shape, stride=tensor.stride())


# the attribute on a parameter holding the TP placement a style gave it (``parameter``, ``keep_placements``)
STYLE_PLACEMENT = "_shardlm_tp_placement"


def parameter(tensor: torch.Tensor, mesh: DeviceMesh, placement: Placement, src: int | None) -> nn.Parameter:
    """``tensor`` distributed by ``placement`` (``_distribute``) as a parameter that keeps it: its
    ``detach`` may come back with another placement (``PartsShard``), so it is put back and recorded."""
    param = nn.Parameter(_distribute(tensor, mesh, placement, src), requires_grad=tensor.requires_grad)
    keep_placement(param, placement)
    setattr(param, STYLE_PLACEMENT, placement)
    return param


def _tp_dim(t: torch.Tensor) -> int | None:
    """The index of the TP mesh dim among ``t``'s placements (None: not a DTensor on a TP mesh)."""
    if not isinstance(t, DTensor) or "tp" not in (t.device_mesh.mesh_dim_names or ()):
        return None
    return t.device_mesh.mesh_dim_names.index("tp")


def tp_placements(model: nn.Module) -> dict[str, Placement]:
    """The TP placement each DTensor parameter of ``model`` was given, by fqn (every name of a tied one).

    The one recorded on it (``parameter``, ``keep_placements``), else its own; an unrecorded
    ``PartsShard`` is read as the ``Shard`` it was (only ``parameter`` makes those: torch's own
    styles create plain ``Shard`` parameters, whose ``detach`` may have come back with parts)."""
    found = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if (mesh_dim := _tp_dim(param)) is None:
            continue
        placement = getattr(param, STYLE_PLACEMENT, None)
        if placement is None:
            placement = param.placements[mesh_dim]
            placement = Shard(placement.dim) if isinstance(placement, PartsShard) else placement
        found[fqn] = placement
    return found


def _rows_key(placement: Placement) -> tuple:
    """What tells apart placements that compare equal (``Shard``, ``PartsShard``, ``RowsShard`` of a dim)."""
    return type(placement), getattr(placement, "parts", None), getattr(placement, "rows", None)


def keep_placement(t: torch.Tensor, placement: Placement) -> None:
    """Put ``placement`` back on the TP mesh dim of ``t`` (in place; the local tensor is unchanged)
    where a DTensor op gave it one that compares equal but holds other rows (``PartsShard``, ``RowsShard``)."""
    if (mesh_dim := _tp_dim(t)) is None:
        return
    now = t.placements[mesh_dim]
    if now == placement and _rows_key(now) != _rows_key(placement):
        placements = (*t.placements[:mesh_dim], placement, *t.placements[mesh_dim + 1 :])
        t._spec = dataclasses.replace(t._spec, placements=placements)  # DTensor keeps its spec in this slot


def keep_placements(model: nn.Module, placements: dict[str, Placement]) -> None:
    """``keep_placement`` on each parameter of ``model`` named in ``placements`` (``tp_placements``
    read before FSDP2 and ``to_empty`` made new tensors), and recorded on it for later reads."""
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if fqn in placements:
            keep_placement(param, placements[fqn])
            setattr(param, STYLE_PLACEMENT, placements[fqn])


def keep_placements_in(state: dict, placements: dict[str, Placement]) -> None:
    """``keep_placement`` on a state dict's values: a model's (``{fqn: tensor}``) or a flattened
    optimizer state dict's (``{"state.<fqn>.<name>": tensor}``), ``placements`` by parameter fqn."""
    for key, value in state.items():
        fqn = key.removeprefix("state.").rpartition(".")[0] if key.startswith("state.") else key
        if fqn in placements:
            keep_placement(value, placements[fqn])


def _tp_parts(param: DTensor, mesh_dim: int) -> tuple[int, ...] | None:
    """The part sizes of a packed placement on the TP mesh dim (None: not packed)."""
    placement = param.placements[mesh_dim]
    if param.device_mesh.mesh_dim_names[mesh_dim] != "tp":
        return None
    if isinstance(placement, PartsShard):
        return placement.parts
    if isinstance(placement, _StridedShard):
        return (param.shape[placement.dim] // placement.split_factor,) * placement.split_factor
    return None


def _tp_rows(param: DTensor, mesh_dim: int) -> RowsShard | None:
    """The ``RowsShard`` on the TP mesh dim (None: another placement)."""
    placement = param.placements[mesh_dim]
    return (
        placement if isinstance(placement, RowsShard) and param.device_mesh.mesh_dim_names[mesh_dim] == "tp" else None
    )


def is_packed(param: torch.Tensor) -> bool:
    """A parameter (or its optimizer state) whose local piece is not torch's chunk of it: ``_StridedShard``,
    ``PartsShard`` or ``RowsShard`` on the TP dim (a packed projection, rows given per rank)."""
    return isinstance(param, DTensor) and any(
        _tp_parts(param, d) or _tp_rows(param, d) for d in range(param.device_mesh.ndim)
    )


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
        if rows := _tp_rows(param, mesh_dim):
            index = rows.local_rows(index, coord)
        elif parts := _tp_parts(param, mesh_dim):
            index = torch.cat([part.chunk(n)[coord] for part in index.split(parts)])
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
    """A DTensor's local piece (of a replicated one, a loss or a norm: the plain tensor every rank holds);
    a plain tensor as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


class _LocalView(torch.autograd.Function):
    """``DTensor.to_local()`` of a parameter, whose backward wraps a gradient of the local piece's strides
    as a DTensor of the parameter's own spec directly. torch's ``_ToTorchTensor`` recomputes the global
    stride and wraps through ``DTensor.from_local`` (a second autograd function and a new spec) for each
    parameter of every step: the largest DTensor entry of a tp=2 step (``benchmarks/README.md``). A
    gradient of other strides takes torch's own way (its global stride computed)."""

    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:
        ctx.spec = param._spec
        ctx.set_materialize_grads(False)
        local = param._local_tensor
        ctx.stride = local.stride()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None
        spec = ctx.spec
        if grad.stride() == ctx.stride and not grad.requires_grad:
            return DTensor(grad, copy.copy(spec), requires_grad=False)
        _, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
        return DTensor.from_local(grad, spec.mesh, spec.placements, shape=spec.shape, stride=tuple(stride))


def local_view(param: torch.Tensor) -> torch.Tensor:
    """The local piece of a (DTensor) parameter, to compute on: ``param.to_local()`` (a parameter's
    placements are never ``Partial``, so its gradient's are its own) with a cheaper backward
    (``_LocalView``); a plain tensor as it is, and a stand-in for the parameter (``row_reads.RowReader``,
    what Gemma 4's embedding holds while its rows are read) by its own ``to_local``."""
    if not isinstance(param, DTensor):
        to_local = getattr(param, "to_local", None)
        return to_local() if to_local is not None else param
    if not (torch.is_grad_enabled() and param.requires_grad):
        return param.to_local()
    local = _LocalView.apply(param)
    if getattr(param, "_is_param", False):  # as ``to_local`` does: a parameter's view is one too
        local._is_param = True
    return local


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
