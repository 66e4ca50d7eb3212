"""The all-to-all (DeepSpeed Ulysses, ALST) way of running attention under ``parallel.cp``.

``parallel.cp_attention: ulysses``. Where the all-gather variant (``context.py``) keeps the rank's
queries and gathers every key and value, Ulysses trades the sequence for the heads: an all-to-all
over the cp group turns each rank's ``[its tokens, all its heads]`` queries, keys and values into
``[every token of the window, heads / cp]``, the model's own attention runs on whole windows for
those heads with the window's whole mask (causal, per document, sliding), and a second all-to-all
turns the output back into ``[its tokens, all its heads]``. Each rank keeps no whole-window K/V of
every head and no mask rows of its own, but the whole ``seq x seq`` mask (built once per micro-batch,
shared by the layers).

The tokens a rank holds are its two head-tail chunks (``data/context_split.py``): after the first
all-to-all the window is put back in window order (``ContextShard.order``), so the mask is the one
transformers would build for the whole window; the output is taken back in the order the ranks
hold their tokens (``ContextShard.gathered``) before the second all-to-all.

Head group ``j`` (query heads ``j*h/cp ..``, key/value heads ``j*kv/cp ..``) goes to cp rank ``j``:
contiguous groups keep GQA's pairing (query head ``i`` reads key/value head ``i // (h/kv)``), so the
layer's ``num_key_value_groups`` still holds. Both head counts (after TP's split) must divide by
``cp`` (refused before spawning, ``context.py: context_parallel_refusal``).

The all-to-all is torch's functional ``all_to_all_single`` (autograd: its backward is the reverse
all-to-all); gloo implements it on CPU, as NCCL does on GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

ATTENTION = "ulysses"  # the value of ``parallel.cp_attention`` that selects this file


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Slot ``j`` of dim 0 of ``x`` to rank ``j``; slot ``r`` of the result from rank ``r`` (autograd)."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def heads_to_window(x: torch.Tensor, cp: int, order: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` ``[batch, heads, local, dim]`` (this rank's tokens, all its heads) -> ``[batch, heads/cp,
    seq_len, dim]``: head group ``rank`` of every rank's tokens, in window order (``order``: the
    ranks' tokens concatenated rank by rank -> window order)."""
    batch, heads, local, dim = x.shape
    slots = x.view(batch, cp, heads // cp, local, dim).transpose(0, 1)  # [cp, batch, heads/cp, local, dim]
    received = _all_to_all(slots, group)  # slot r: rank r's tokens, this rank's head group
    window = received.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * local, dim)
    return window[:, :, order]


def window_to_heads(y: torch.Tensor, cp: int, gathered: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The attention output ``[batch, seq_len, heads/cp, dim]`` (window order, this rank's head group)
    -> ``[batch, local, heads, dim]``: this rank's tokens, every head (``gathered``: window positions
    of the ranks' tokens, rank by rank)."""
    batch, seq_len, group_heads, dim = y.shape
    local = seq_len // cp
    slots = y[:, gathered].view(batch, cp, local, group_heads, dim).transpose(0, 1)  # slot r: rank r's tokens
    received = _all_to_all(slots, group)  # slot j: head group j of this rank's tokens
    return received.permute(1, 2, 0, 3, 4).reshape(batch, local, cp * group_heads, dim)


def ulysses_refusal(heads: int, kv_heads: int, tp: int, cp: int) -> str | None:
    """Why ``heads`` query and ``kv_heads`` key/value heads cannot be split over ``cp`` after TP's
    split over ``tp`` (kv heads fewer than tp are replicated, one a rank), or None when they can."""
    local, local_kv = heads // tp, max(1, kv_heads // tp)
    for what, count in (("query heads", local), ("key/value heads", local_kv)):
        if count % cp:
            per_rank = f" per tp rank (of {tp})" if tp > 1 else ""
            return f"its {count} {what}{per_rank} do not divide by cp={cp} (Ulysses gives each cp rank heads/cp)"
    return None
