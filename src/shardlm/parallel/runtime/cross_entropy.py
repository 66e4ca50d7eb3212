"""The vocabulary-parallel cross-entropy (Megatron-LM's ``vocab_parallel_cross_entropy``) on the local logits
of the TP-sharded LM head (``Colwise(sharded_output=True)``: a ``Shard(-1)`` DTensor over the TP mesh).

Each rank holds the logits of its vocabulary rows only. The per-token loss ``log(sum exp x) - x[target]``
needs three sums over the vocabulary, each an all-reduce of one number per token, the three torch's
``loss_parallel`` issues (the bench's analytic count, ``benchmarks/README.md``): the max (for a stable exp),
the sum of the shifted exps, and the target's shifted logit, which only the rank owning the target's row
holds (the others add 0). The backward is local: ``softmax - one_hot(target)`` on this rank's rows, times
the token's gradient. Computed on plain tensors in an autograd function, as ``regions.py``'s collectives
are: ``loss_parallel`` ran the same arithmetic op by op through DTensor's dispatch. Ignored tokens
(``ignore_index``) add exactly 0 to the loss and get exactly zero gradient.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardlm.parallel.runtime.regions import all_reduce


def is_vocab_sharded(logits: torch.Tensor) -> bool:
    """``logits`` are the TP-sharded LM head's: a DTensor split over its last (vocabulary) dim on one mesh dim."""
    if not isinstance(logits, DTensor) or logits.device_mesh.ndim != 1:
        return False
    (placement,) = logits.placements
    return isinstance(placement, Shard) and placement.dim in (-1, logits.dim() - 1)


def vocab_parallel_token_losses(logits: DTensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per-token cross-entropy ``[N]`` (fp32, 0 where ``labels == ignore_index``) of the vocabulary-sharded
    ``logits`` ``[..., vocab]`` (``is_vocab_sharded``) against ``labels`` ``[...]``, replicated over TP; a plain
    tensor, its gradient flowing back to the logits' local pieces."""
    mesh = logits.device_mesh
    local = logits.to_local()
    local = local.reshape(-1, local.shape[-1]).float()
    start = _vocab_start(logits.shape[-1], mesh)
    return _VocabParallelCrossEntropy.apply(local, labels.reshape(-1), start, ignore_index, mesh)


def _vocab_start(vocab: int, mesh: DeviceMesh) -> int:
    """The first vocabulary row of this rank's logits: ``Shard`` splits as ``torch.chunk`` does (pieces of
    ``ceil(vocab / tp)`` rows, the last ones shorter or empty)."""
    chunk = -(-vocab // mesh.size())
    return min(mesh.get_local_rank() * chunk, vocab)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, labels: torch.Tensor, start: int, ignore_index: int, mesh: DeviceMesh):
        valid = labels != ignore_index
        local = labels - start
        mine = valid & (local >= 0) & (local < x.shape[-1])  # the target's row is on this rank
        local = torch.where(mine, local, 0)
        x_max = all_reduce(x.amax(dim=-1, keepdim=True), mesh, "max")
        shifted = x - x_max
        target = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp_()  # in place: the shifted logits are not read again
        sum_exp = all_reduce(exp.sum(dim=-1, keepdim=True), mesh)
        target = all_reduce(target, mesh)
        losses = torch.where(valid, sum_exp.squeeze(-1).log() - target, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp), local, mine, valid)  # the softmax of this rank's rows
        return losses

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mine, valid = ctx.saved_tensors
        scale = torch.where(valid, grad, 0.0)
        grad_x = softmax * scale.unsqueeze(-1)
        rows = torch.arange(grad_x.shape[0], device=grad_x.device)
        grad_x[rows, local] -= torch.where(mine, scale, 0.0)
        return grad_x, None, None, None, None
