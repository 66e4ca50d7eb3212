"""TP-partial gradients: what each TP rank holds only a partial sum of, and the sums over TP.

``SumGradsOverTP`` sums the gradients of a region's inputs in backward (one all-reduce);
``tp_partial_grad_params`` lists the parameters whose gradients each rank computes from its own heads,
rows or share only, and ``sum_tp_partial_grads`` sums them over TP once per step (the trainer calls it
before clipping).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from shardlm.parallel.plan.channels import param_rows
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import Style


def _all_reduce(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum over TP of ``t`` (outside autograd: in a backward)."""
    return DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class SumGradsOverTP(torch.autograd.Function):
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
        flat = _all_reduce(torch.cat([g.reshape(-1).to(dtype) for g in present]), ctx.mesh)
        out, offset = [], 0
        for g in grads:
            if g is None:
                out.append(None)
                continue
            out.append(flat[offset : offset + g.numel()].view(g.shape).to(g.dtype))
            offset += g.numel()
        return (None, *out)


def tp_partial_grad_params(model: nn.Module, plan: Plan) -> list[str]:
    """FQNs of parameters whose gradients must be summed over TP (``replicate_grad_allreduce``,
    the replicated parameters of sliced projections and of ``per_channel`` modules following
    them, and experts' parameters added ``once``)."""
    return channel_partial_grads(model, plan) + [
        f"{fqn}.{pname}"
        for fqn, style in plan.styles.items()
        for pname, _ in model.get_submodule(fqn).named_parameters(recurse=False)
        if style == Style.REPLICATE_GRAD_ALLREDUCE
        or fqn in plan.sliced
        or (style == Style.EXPERTS and getattr(plan.experts.get(fqn, {}).get(pname), "once", False))
    ]


@torch.no_grad()
def sum_tp_partial_grads(model: nn.Module, names: list[str], tp_group: dist.ProcessGroup) -> None:
    """All-reduce over TP the gradients that each rank computed from its own heads only: one
    all-reduce per dtype over the flattened gradients (they are small: norms, kv projections)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for name in names:
        grad = model.get_parameter(name).grad
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_dtype.setdefault(local.dtype, []).append(local)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def channel_partial_grads(model: nn.Module, plan: Plan) -> list[str]:
    """Parameters stored whole whose gradient each rank computes for its rows only: summed over TP."""
    return [
        f"{fqn}.{p}"
        for fqn, params in plan.channels.items()
        for p in params
        if param_rows(plan, fqn, p) is not None and p in dict(model.get_submodule(fqn).named_parameters(recurse=False))
    ]
