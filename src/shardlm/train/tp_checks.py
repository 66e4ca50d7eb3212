"""Checks that the ranks of a tensor-parallel group train the same model on the same data.

A TP group computing on different inputs, or holding different copies of a replicated
parameter, trains garbage without any error: nothing in DTensor compares the replicas. The
trainer runs these checks on the first steps and on every logging step (``train/trainer.py``);
each costs one all-reduce of a few checksums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardlm.data.dataset import Batch


def check_tp_batches(batches: list[Batch], tp_group: dist.ProcessGroup, step: int) -> None:
    """Raise if the ranks of this TP group hold different batches (one all-reduce of a checksum)."""
    parts = []
    for b in batches:
        parts += [b.input_ids.flatten(), b.labels.flatten()]
        if b.position_ids is not None:
            parts.append(b.position_ids.flatten())
    flat = torch.cat(parts).long()
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.long)
    mine = torch.stack([(flat * weights).sum(), flat.sum(), torch.tensor(flat.numel(), device=flat.device)])
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=tp_group)
    if torch.equal(both[:3], -both[3:]):
        return
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(gathered, mine, group=tp_group)
    ranks = dist.get_process_group_ranks(tp_group)
    kinds: dict[tuple, list[int]] = {}
    for rank, value in zip(ranks, gathered, strict=True):
        kinds.setdefault(tuple(value.tolist()), []).append(rank)
    groups = " vs ".join(str(r) for r in kinds.values())
    raise RuntimeError(
        f"tensor-parallel ranks {ranks} got different batches at step {step + 1} (ranks {groups}); every rank of "
        "a TP group must read the same samples: give each rank the same dataset and seed"
    )


def tp_replicated_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters replicated across the TP ranks (Replicate on the mesh's ``tp`` dim): every
    TP rank must hold the same values (under FSDP: the same shard)."""
    out = []
    for name, param in model.named_parameters():
        names = (param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()
        if "tp" in names and param.placements[names.index("tp")].is_replicate():
            out.append((name, param))
    return out


@torch.no_grad()
def check_tp_replicas(params: list[tuple[str, torch.Tensor]], tp_group: dist.ProcessGroup, step: int) -> None:
    """Raise if the TP ranks' copies of a replicated parameter differ (one all-reduce of two
    checksums per parameter): the TP group would be training different models without any error,
    e.g. from random numbers drawn per rank that ``parallel/runtime/dropout.py`` does not replace."""
    if not params:
        return
    sums = []
    for _, param in params:
        local = param.to_local().double()
        sums += [local.sum(), local.pow(2).sum()]
    mine = torch.nan_to_num(torch.stack(sums), nan=1e300)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=tp_group)
    differ = (both[: mine.numel()] != -both[mine.numel() :]).view(-1, 2).any(1).nonzero().flatten().tolist()
    if differ:
        names = [params[i][0] for i in differ]
        raise RuntimeError(
            f"tensor-parallel ranks {dist.get_process_group_ranks(tp_group)} hold different values of replicated "
            f"parameter {names[0]} ({len(names)} differ) after step {step}: they are training different models; "
            "something in the model draws random numbers per rank (an attention kernel's own dropout?)"
        )
