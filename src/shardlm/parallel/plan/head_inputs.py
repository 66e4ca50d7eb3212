"""Each rank's heads of the per-head tensors a split attention module is handed (``Plan.head_inputs``:
BLOOM's ALiBi bias, MPT's position bias; ``infer/head_inputs.py`` finds them). Applied by the builder
and by the dry run alike, so it belongs to the plan."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlm.parallel.plan.local_geometry import own_geometry
from shardlm.parallel.plan.plan import Plan

BUFFER = "self."  # a module's own buffer among its per-head inputs (``infer/head_inputs.py`` keys it so)


def own_heads(t: torch.Tensor, dim: int, heads: int, tp: int, rank: int) -> torch.Tensor:
    """Rank's heads of ``t`` along ``dim``, of ``heads`` (or ``batch * heads``, batch outer: BLOOM's
    ``[batch * heads, 1, keys]``): the rows of its own heads, at their global index."""
    per_rank = heads // tp
    return t.unflatten(dim, (-1, heads)).narrow(dim + 1, rank * per_rank, per_rank).flatten(dim, dim + 1)


def slice_head_inputs(model: nn.Module, plan: Plan, tp: int, rank: int) -> None:
    """Hook every module of ``plan.head_inputs`` to see its rank's heads of those inputs; its own per-head
    buffers (keys ``self.<buffer>``: MiniMax's slopes and decays) are its heads' rows while it runs,
    stored whole (a checkpoint holds what one process holds)."""
    for fqn, found in plan.head_inputs.items():
        saved: list[tuple[str, torch.Tensor]] = []
        # the module's own whole head count (ProphetNet's decoder: not its config's num_attention_heads), read
        # before ``localize_geometry`` makes it local
        heads = own_geometry(model.get_submodule(fqn), fqn, plan)[0]

        def hook(module, args, kwargs, found=found, saved=saved, heads=heads):
            args = list(args)
            for key, dim in found.items():
                if isinstance(key, int) and key < len(args) and isinstance(args[key], torch.Tensor):
                    args[key] = own_heads(args[key], dim, heads, tp, rank)
                elif isinstance(key, str) and key.startswith(BUFFER):
                    name = key.removeprefix(BUFFER)
                    saved.append((name, module._buffers[name]))
                    module._buffers[name] = own_heads(module._buffers[name], dim, heads, tp, rank)
                elif isinstance(key, str) and isinstance(kwargs.get(key), torch.Tensor):
                    kwargs[key] = own_heads(kwargs[key], dim, heads, tp, rank)
            return tuple(args), kwargs

        def restore(module, args, out, saved=saved):
            while saved:
                name, buffer = saved.pop()
                module._buffers[name] = buffer

        module = model.get_submodule(fqn)
        module.register_forward_pre_hook(hook, with_kwargs=True)
        module.register_forward_hook(restore)
