"""The TP collectives of the styles, named once, in the vocabulary of Megatron-LM's
``tensor_parallel/mappings.py`` (a *region* is the stretch of a forward computed on this rank's pieces):

``copy_to_region``      forward: identity (the replicated input enters the region); backward: the
                        input's gradient, which covers this rank's pieces only, summed over TP
                        (Megatron's ``copy_to_tensor_model_parallel_region``, its "f").
``CopyToRegion``        the same for several tensors at once, their gradients summed in one all-reduce.
``reduce_from_region``  forward: the partial sums of the region added over TP (an all-reduce);
                        backward: identity (Megatron's ``reduce_from_tensor_model_parallel_region``,
                        its "g"). Called inside a backward it is the bare sum.

Under sequence parallelism (``parallel.sequence_parallel``, ``sequence.py``) the residual stream is this
rank's slice of the sequence (``sequence_dim``), and three more regions, Megatron's sequence-parallel mappings:

``scatter_to_sequence_region``  forward: this rank's slice of a replicated activation (no communication);
                                backward: the slices' gradients all-gathered (the stream enters the blocks).
``gather_from_sequence_region`` forward: the slices all-gathered into the whole sequence; backward: this
                                rank's slice of the (replicated) gradient (the stream leaves the blocks).
``gather_to_column_region``     forward: the slices all-gathered, as the replicated DTensor that column-parallel
                                layers read; backward: their partial gradients reduce-scattered back to the
                                slices (Megatron's all-gather before a column-parallel linear).

``reduce_scatter_to_sequence_region``  forward: a row-parallel layer's partial sums added over TP and
                                scattered to the slices (a reduce-scatter); backward: the slices' gradients
                                all-gathered (``linear.Rowwise("scattered")``).

``reduce_scatter_in_place``  a reduce-scatter whose result keeps the whole shape (this rank's slice of the sum,
                            zeros elsewhere); ``own_sequence_slice`` takes the slice out of it (Megatron's
                            reduce-scattered embeddings, where the model's forward still runs between them).

The vocabulary-parallel embedding (``embedding.py``) sums its masked lookups with ``reduce_from_region``
(``reduce_scatter_in_place`` where the stream enters its slices there: ``plan.sequence.stream_ends``), and
the vocabulary-parallel cross-entropy (``cross_entropy.py``) its max, sum-exp and target logit with ``all_reduce``.
Megatron's gather and scatter regions are not hand-written here: sequence shapes and FSDP gather and scatter
through DTensor's own ``Shard`` placements.
``ShardedRMSNorm`` (``replicate.py``) sums its squares both ways (forward all-reduce,
backward all-reduce of the gradient) on its own, and the per-step sum of the TP-partial gradients is
``grads.sum_tp_partial_grads``.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def sequence_dim(x: torch.Tensor) -> int:
    """The dim of ``x`` the sequence is split on: the one before the features, the sequence of
    ``[batch, sequence, hidden]`` or the tokens of a flattened ``[batch * sequence, hidden]`` (OPT
    flattens its MLP's input): either way a rank's slice is its positions of every sample, in order."""
    return x.dim() - 2


def copy_to_region(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` (replicated) with the same values, its gradient summed over TP on the way back (an all-reduce
    of a plain tensor: no DTensor dispatch)."""
    return _CopyToRegion.apply(x, mesh)


def reduce_from_region(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum over TP of each rank's partial ``t`` (forward all-reduce; backward identity): a tensor of
    its own, which models may modify in place (CTRL scales its embeddings with ``*=``)."""
    return _ReduceFromRegion.apply(t, mesh)


def all_reduce(t: torch.Tensor, mesh: DeviceMesh, op: str = "sum") -> torch.Tensor:
    """The bare sum (``op``: or ``"max"``) over ``mesh`` (no autograd): torch's functional all-reduce, the op
    DTensor's own redistributions issue, on a plain tensor (no DTensor dispatch)."""
    group = mesh.get_group().group_name
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(t, op, group))


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.mesh), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return all_reduce(t, mesh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def scatter_to_sequence_region(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's slice (dim 1) of the replicated ``x``; backward: the slices' gradients all-gathered."""
    check_sequence_splits(x, mesh)
    view = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return view.redistribute(mesh, [Shard(sequence_dim(x))]).to_local()


def gather_from_sequence_region(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole sequence of the slices ``x`` (an all-gather); backward: this rank's slice of the gradient,
    which every rank holds whole."""
    view = DTensor.from_local(x, mesh, [Shard(sequence_dim(x))], run_check=False)
    return view.redistribute(mesh, [Replicate()]).to_local()


def gather_to_column_region(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """The whole sequence of the slices ``x`` as a replicated DTensor, for column-parallel layers to read;
    backward: their partial gradients summed over TP and scattered back to the slices (a reduce-scatter)."""
    return DTensor.from_local(x, mesh, [Shard(sequence_dim(x))], run_check=False).redistribute(mesh, [Replicate()])


def reduce_scatter_to_sequence_region(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's slice of the sum over TP of each rank's partial ``t`` (or of a ``Partial`` DTensor),
    scattered on its ``sequence_dim``; backward: the slices' gradients all-gathered."""
    check_sequence_splits(t, mesh)
    view = t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Partial()], run_check=False)
    return view.redistribute(mesh, [Shard(sequence_dim(t))]).to_local()


def reduce_scatter_in_place(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum over TP of each rank's partial ``t`` at this rank's slice of the sequence (a reduce-scatter),
    zeros at the other ranks' positions, in ``t``'s whole shape: the model's forward between the
    embedding and the first block (masks, rotary, a scale or dropout per token) keeps reading the shape
    it built, and the first block takes the slice (``own_sequence_slice``). Backward: the slice of the
    gradient all-gathered (what is at the other positions came from the zeros and is not used)."""
    mine = reduce_scatter_to_sequence_region(t, mesh)
    dim, rank = sequence_dim(t), mesh.get_local_rank()
    sizes = [mine.shape[dim] * rank, mine.shape[dim] * (mesh.size() - rank - 1)]
    before, after = (mine.new_zeros(mine.shape[:dim] + (n,) + mine.shape[dim + 1 :]) for n in sizes)
    return torch.cat([before, mine, after], dim)


def own_sequence_slice(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's slice of ``x``, which holds only it (``reduce_scatter_in_place``); backward: the
    slice's gradient in place, zeros elsewhere (no communication)."""
    check_sequence_splits(x, mesh)
    n = x.shape[sequence_dim(x)] // mesh.size()
    return x.narrow(sequence_dim(x), n * mesh.get_local_rank(), n)


def check_sequence_splits(x: torch.Tensor, mesh: DeviceMesh) -> None:
    """The sequence dim of ``x`` divides evenly over TP (preflight checks ``data.seq_len``; this is the
    same rule for what actually arrives, an evaluation batch included)."""
    tp = mesh.size()
    if x.dim() < 2 or x.shape[sequence_dim(x)] % tp:
        raise RuntimeError(
            f"sequence parallelism: an activation of shape {list(x.shape)} does not split its sequence "
            f"(dim {sequence_dim(x)}) into {tp} equal slices"
        )


class CopyToRegion(torch.autograd.Function):
    """Identity forward; backward: the gradients of all its inputs summed over TP in one all-reduce
    (flattened together, in the widest of their dtypes)."""

    @staticmethod
    def forward(ctx, mesh: DeviceMesh, *tensors: torch.Tensor):
        ctx.mesh = mesh
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        present = [g for g in grads if g is not None]
        if not present:
            return (None, *grads)
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in present))
        flat = reduce_from_region(torch.cat([g.reshape(-1).to(dtype) for g in present]), ctx.mesh)
        out, offset = [], 0
        for g in grads:
            if g is None:
                out.append(None)
                continue
            out.append(flat[offset : offset + g.numel()].view(g.shape).to(g.dtype))
            offset += g.numel()
        return (None, *out)
