"""What the experts probes (``experts.py``: fused experts modules; ``expert_blocks.py``: blocks of
per-expert linears) share: the positions a rank holds of a dim split in parts, the candidate
placements of one parameter, and the probe's sizes and tolerance.
"""

from __future__ import annotations

import torch

from shardlm.parallel.model.experts import EVERY_TOKEN, FOLDED
from shardlm.parallel.plan.styles import ExpertParam

PROBE_TOKENS = 5


PROBE_RTOL = 1e-6  # of the output's largest value; a wrong placement is off by O(1)


def local_positions(size: int, parts: int, tp: int, rank: int) -> torch.Tensor:
    """Positions along a dim of ``size`` that rank holds when it is split ``tp`` ways in ``parts``
    parts each on its own (``_StridedShard(dim, split_factor=parts)``; parts 1: ``Shard``)."""
    return torch.cat([part.chunk(tp)[rank] for part in torch.arange(size).chunk(parts)])


def rank_piece(value: torch.Tensor, param: ExpertParam, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of parameter ``value`` placed as ``param``: its positions of the split dim, or the
    whole tensor on rank 0 and zeros elsewhere for a parameter added once after the ranks' sum."""
    if param.dim is not None:
        return value.index_select(param.dim, local_positions(value.shape[param.dim], param.parts, tp, rank))
    return torch.zeros_like(value) if param.once and rank else value


def options(shape: tuple[int, ...], hidden: int, tp: int, once: bool = True) -> list[ExpertParam]:
    """Candidate placements of one parameter of experts, preferred first: the dims that are not the
    hidden width, 1 part before 2; a 2-D one (a bias ``[E, X]``) also whole and added once (``once``),
    first where it is hidden-wide (after the down projection)."""
    dims = sorted(range(1, len(shape)), key=lambda d: shape[d] == hidden)
    split = [ExpertParam(d, parts) for d in dims for parts in (1, 2) if shape[d] % (tp * parts) == 0]
    if len(shape) == 2 and once:
        added = ExpertParam(None, once=True)
        split = [added, *split] if shape[1] == hidden else [*split, added]
    return split


def probe_inputs(experts: int, hidden: int, call: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random fp64 inputs of an experts forward on ``experts`` experts, as it is called
    (``model.experts.experts_call``): transformers' kernels' hidden states, top-2 expert indices and
    routing weights; the routing folded in (Llama 4): every expert's rows ``[experts * tokens, hidden]``;
    every expert on every token (Inkling's shared experts): the hidden states and each token's weights."""
    if call == FOLDED:
        return (torch.randn(experts * PROBE_TOKENS, hidden, generator=g, dtype=torch.float64),)
    x = torch.randn(PROBE_TOKENS, hidden, generator=g, dtype=torch.float64)
    if call == EVERY_TOKEN:
        return x, torch.rand(PROBE_TOKENS, experts, generator=g, dtype=torch.float64) + 0.5
    top_k = min(2, experts)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(PROBE_TOKENS)])
    weights = torch.rand(PROBE_TOKENS, top_k, generator=g, dtype=torch.float64) + 0.5
    return x, index, weights
