"""Gradient clipping on the global L2 norm of every parameter, whatever its placement or mesh.

``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms with ``_foreach_norm``; with
some gradients DTensors and some plain, or DTensors on different meshes, it raises
``aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor`` (transformers' TP loop and
other trainers hit this). Here each rank sums the squares of the gradient pieces it holds,
dividing a piece by the number of ranks that hold an identical copy of it (replicated mesh
dims, ranks outside the tensor's mesh, plain tensors everywhere), and one all-reduce over the
world adds it up. Uneven shards need no special case. Pipeline stages (``stages`` > 1) hold different
parameters: copies are counted within this rank's stage, and the world's sum adds the stages up.
Call it after gradients are reduced across data-parallel ranks and before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from shardlm.distributed.shards import as_local


def _copies(grad: torch.Tensor, world_size: int) -> int:
    """How many ranks of the world hold an identical copy of this rank's piece of ``grad``."""
    if not isinstance(grad, DTensor):
        return world_size
    mesh = grad.device_mesh
    copies = world_size // mesh.size()
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Partial):
            raise ValueError("clip_grad_norm_: gradient is still Partial; reduce it before clipping")
        if isinstance(placement, Replicate):
            copies *= mesh.size(dim)
    return copies


@torch.no_grad()
def total_norm(grads: list[torch.Tensor], stages: int = 1) -> torch.Tensor:
    """Global L2 norm of ``grads`` (fp32 scalar, identical on every rank); ``stages``: ``parallel.pp``.
    The local pieces are grouped by their number of copies, each group's norms taken in one foreach op
    (a few ops a step in place of four per gradient: ``benchmarks/README.md``)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    device = grads[0].device if grads else torch.device("cpu")
    groups: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(_copies(g, world_size // stages), []).append(as_local(g))
    acc = torch.zeros((), dtype=torch.float32, device=device)
    for copies, pieces in groups.items():
        norms = torch._foreach_norm(pieces, 2.0, dtype=torch.float32)
        acc += torch.stack(norms).pow(2).sum() / copies
    if world_size > 1:
        dist.all_reduce(acc)
    return acc.sqrt()


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, stages: int = 1, elsewhere: Iterable[torch.Tensor] = ()
) -> torch.Tensor:
    """Clip gradients in place to global norm ``max_norm`` (no-op if <= 0); return the norm before.
    ``stages``: pipeline stages (``parallel.pp``) over which the parameters are divided; ``elsewhere``:
    parameters whose identical copy another stage holds and counts (a tied embedding's on the last stage),
    clipped here but left out of the norm."""
    skip = {id(p) for p in elsewhere}
    held = [p for p in parameters if p.grad is not None]
    norm = total_norm([p.grad for p in held if id(p) not in skip], stages)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in held:
            by_dtype.setdefault(p.grad.dtype, []).append(as_local(p.grad))
        for dtype, pieces in by_dtype.items():
            torch._foreach_mul_(pieces, coef.to(dtype))
    return norm
