"""The TP collectives of the styles, named once, in the vocabulary of Megatron-LM's
``tensor_parallel/mappings.py`` (a *region* is the stretch of a forward computed on this rank's pieces):

``copy_to_region``      forward: identity (the replicated input enters the region); backward: the
                        input's gradient, which covers this rank's pieces only, summed over TP
                        (Megatron's ``copy_to_tensor_model_parallel_region``, its "f").
``CopyToRegion``        the same for several tensors at once, their gradients summed in one all-reduce.
``reduce_from_region``  forward: the partial sums of the region added over TP (an all-reduce);
                        backward: identity (Megatron's ``reduce_from_tensor_model_parallel_region``,
                        its "g"). Called inside a backward it is the bare sum.

Megatron's gather and scatter regions are not hand-written here: the vocabulary-sharded embedding and
LM head (``loss_parallel``), sequence shapes and FSDP gather and scatter through DTensor's own
``Shard`` placements. ``ShardedRMSNorm`` (``replicate.py``) sums its squares both ways (forward all-reduce,
backward all-reduce of the gradient) on its own, and the per-step sum of the TP-partial gradients is
``grads.sum_tp_partial_grads``.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def copy_to_region(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` (replicated; or its replicated DTensor view, shared by the layers reading it) with the same
    values, its gradient summed over TP on the way back."""
    view = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return view.to_local(grad_placements=[Partial()])


def reduce_from_region(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum over TP of each rank's partial ``t`` (forward all-reduce; backward identity)."""
    return DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


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
