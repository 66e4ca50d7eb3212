"""Evaluation: the token-weighted loss over an eval set, sharded over the data-parallel ranks.

The eval set is read in file order, each dp rank taking every dp_size-th micro-batch, under
``torch.no_grad`` and ``model.eval()``; the loss is the sum of token losses over the count of
labelled tokens of the whole set, as one process computes it (``train/loss.py``). Document-packed
samples go in with their ``position_ids``, as in training.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardlm.data.dataset import Batch, TokenDataset
from shardlm.data.rows import IGNORE_INDEX
from shardlm.distributed.mesh import Mesh
from shardlm.distributed.shards import as_local
from shardlm.parallel.plan.stages import stage_owner
from shardlm.parallel.runtime.context import ContextShard, context_parallel
from shardlm.train.loss import token_loss_sum


def eval_batches(ds: TokenDataset, dp_rank: int, dp_size: int, per_device: int, max_batches: int | None):
    """This dp rank's eval batches in file order; a rank past the end gets an all-ignored sample,
    so every rank runs the same number of forwards (FSDP's collectives need them all)."""
    count = math.ceil(len(ds) / (per_device * dp_size))
    for b in range(min(count, max_batches) if max_batches else count):
        start = (b * dp_size + dp_rank) * per_device
        end = min(start + per_device, len(ds))
        positions = ds.position_ids
        if start >= end:
            yield Batch(ds.input_ids[:1], torch.full_like(ds.labels[:1], IGNORE_INDEX), _rows(positions, 0, 1))
        else:
            yield Batch(ds.input_ids[start:end], ds.labels[start:end], _rows(positions, start, end))


def _rows(positions: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if positions is None else positions[start:end]


@torch.no_grad()
def eval_loss(
    module: nn.Module,
    logits_of: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor | None],
    ds: TokenDataset,
    mesh: Mesh,
    per_device: int,
    max_batches: int | None,
    shard_of: Callable[[Batch], tuple[Batch, ContextShard | None]] | None = None,
) -> tuple[float, int]:
    """Collective: the token-weighted loss of ``logits_of`` over ``ds`` and its labelled token
    count (the module is left in the mode it was in). Under ``parallel.pp``, ``module`` is the stage
    and ``logits_of`` gives logits on the last stage only (None elsewhere), whose sums every stage takes.
    ``shard_of``: this rank's tokens of a batch under context parallelism and their shard
    (``Trainer.context_shard``); the loss and the count are then summed over the cp ranks too."""
    p = mesh.parallel
    was_training = module.training
    module.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=mesh.device)
    try:
        for batch in eval_batches(ds, mesh.dp_rank, p.dp_size, per_device, max_batches):
            batch, shard = shard_of(batch.to(mesh.device)) if shard_of is not None else (batch.to(mesh.device), None)
            with context_parallel(shard):
                logits = logits_of(batch.input_ids, batch.position_ids)
            if logits is not None:
                totals[0] += as_local(token_loss_sum(logits, batch.labels)).double()
            totals[1] += (batch.labels != IGNORE_INDEX).sum()
    finally:
        module.train(was_training)
        # a forward without backward leaves the FSDP root unsharded (its reshard waits for the
        # backward): put the sharded fp32 parameters back before anything reads or saves them
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
    mesh.sum_over_tokens(totals)
    if p.pp > 1:  # the loss sums are the last stage's (on rank 0 of the pipeline under a V-shaped schedule)
        last = stage_owner(p.pp * p.pp_stages_per_rank - 1, p.pp, p.pp_stages_per_rank, p.pp_v_shaped)
        dist.broadcast(totals, group_src=last, group=mesh.pp.get_group())
    loss = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
    return loss, int(totals[1])
