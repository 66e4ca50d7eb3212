"""Token-weighted cross-entropy on vocabulary shards equals ``F.cross_entropy`` on the full logits.

The sharded path (a ``Shard(-1)`` DTensor: ``parallel/runtime/cross_entropy.py`` on its local pieces)
never gathers the logits; its loss and its gradient must still be those of one process on the full
tensor (a vocabulary that does not split evenly too), ignored positions must get exactly zero gradient,
and a micro-batch with no real label must add exactly 0 (never NaN) to the loss and to the gradients.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks

from shardlm.data.rows import IGNORE_INDEX
from shardlm.distributed.shards import as_local
from shardlm.train.loss import token_loss_sum

BATCH, SEQ, VOCAB = 3, 8, 64


def _logits_and_labels(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same full logits and labels on every rank, with some positions IGNORE_INDEX."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=g) * 3
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, -3:] = IGNORE_INDEX  # padding at the end of a sample
    labels[1, :2] = IGNORE_INDEX  # a masked prompt
    labels[2, 4] = IGNORE_INDEX
    return logits, labels


def _reference(full: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and d loss / d logits of one process on the full tensor."""
    leaf = full.clone().requires_grad_(True)
    flat = leaf.reshape(-1, full.shape[-1])
    loss = F.cross_entropy(flat, labels.reshape(-1), reduction="sum", ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), leaf.grad


def _sharded_loss_and_grad(full: torch.Tensor, labels: torch.Tensor, tp_mesh) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    logits = distribute_tensor(full.clone(), tp_mesh, [Shard(-1)]).requires_grad_(True)
    loss = token_loss_sum(logits, labels)
    loss.backward()
    assert isinstance(logits.grad, DTensor) and logits.grad.placements == (Shard(2),)
    return as_local(loss).detach(), logits.grad.full_tensor()


def _sharded_checks() -> dict:
    """Rank body (tp=2): sharded loss/grad vs the full-tensor reference, and an all-ignored batch."""
    from shardlm.config import ParallelConfig
    from shardlm.distributed.mesh import build_mesh, init_distributed

    init_distributed()
    mesh = build_mesh(ParallelConfig(tp=2))
    full, labels = _logits_and_labels()
    loss, grad = _sharded_loss_and_grad(full, labels, mesh.tp)
    ref_loss, ref_grad = _reference(full, labels)
    empty_labels = torch.full_like(labels, IGNORE_INDEX)
    empty_loss, empty_grad = _sharded_loss_and_grad(full, empty_labels, mesh.tp)
    # a vocabulary of 63: rows 0-31 on rank 0, 32-62 on rank 1 (``Shard`` splits as torch.chunk)
    odd_labels = torch.where(labels == VOCAB - 1, 31, labels)
    odd_loss, odd_grad = _sharded_loss_and_grad(full[..., :-1], odd_labels, mesh.tp)
    odd_ref_loss, odd_ref_grad = _reference(full[..., :-1], odd_labels)
    return {
        "odd_loss_rel_diff": abs(odd_loss.item() - odd_ref_loss.item()) / abs(odd_ref_loss.item()),
        "odd_grad_max_abs_diff": (odd_grad - odd_ref_grad).abs().max().item(),
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "grad_max_abs_diff": (grad - ref_grad).abs().max().item(),
        "ignored_grad_max_abs": grad[labels == IGNORE_INDEX].abs().max().item(),
        "ignored_rows": int((labels == IGNORE_INDEX).sum()),
        "empty_loss": empty_loss.item(),
        "empty_grad_max_abs": empty_grad.abs().max().item(),
        "empty_grad_finite": bool(torch.isfinite(empty_grad).all()),
    }


@pytest.mark.ranks
def test_vocab_sharded_loss_matches_full_cross_entropy():
    got = run_ranks(_sharded_checks, 2)
    assert abs(got["loss"] - got["ref_loss"]) <= 1e-6 * abs(got["ref_loss"]), got
    assert got["grad_max_abs_diff"] <= 1e-6, got
    assert got["odd_loss_rel_diff"] <= 1e-6 and got["odd_grad_max_abs_diff"] <= 1e-6, got
    assert got["ignored_rows"] == 6
    assert got["ignored_grad_max_abs"] == 0.0, got
    # a micro-batch with no real label: exactly 0, and exactly zero gradient, on vocab shards too
    assert got["empty_loss"] == 0.0, got
    assert got["empty_grad_finite"] and got["empty_grad_max_abs"] == 0.0, got


def test_plain_loss_matches_cross_entropy():
    full, labels = _logits_and_labels(seed=1)
    leaf = full.clone().requires_grad_(True)
    loss = token_loss_sum(leaf, labels)
    loss.backward()
    ref_loss, ref_grad = _reference(full, labels)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    torch.testing.assert_close(leaf.grad, ref_grad, rtol=0, atol=1e-6)
    assert leaf.grad[labels == IGNORE_INDEX].abs().max().item() == 0.0


def test_plain_loss_upcasts_bf16_logits():
    """bf16 logits are reduced in fp32: the result is the fp32 loss of the bf16 values."""
    full, labels = _logits_and_labels(seed=2)
    low = full.bfloat16()
    loss = token_loss_sum(low, labels)
    ref_loss, _ = _reference(low.float(), labels)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())


def test_plain_all_ignored_batch_is_exactly_zero():
    full, _ = _logits_and_labels(seed=3)
    labels = torch.full((BATCH, SEQ), IGNORE_INDEX)
    leaf = full.clone().requires_grad_(True)
    loss = token_loss_sum(leaf, labels)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(leaf.grad).all() and leaf.grad.abs().max().item() == 0.0
