"""Context parallelism: attention over a sequence split between ranks, with unmodified HF modeling code.

Each rank of a cp group holds two chunks of every window (``data/context_split.py``): its
embeddings, MLPs, norms and loss see only those tokens. Attention is the one place tokens meet, so
the model's attention function is replaced through transformers' ``AttentionInterface`` (the
``attn_implementation`` every modern modeling file dispatches on) by ``context_attention``:

* the rank's keys and values are all-gathered over the cp group (an autograd all-gather: their
  gradients come back by reduce-scatter, summed over the ranks whose queries used them) and put
  back in window order;
* the mask is built here, for the rank's query rows against every key, from the *global* position
  ids of the window: causal, within one document (position ids restarting at each packed document,
  as ``masking_utils.find_packed_sequence_indices`` reads them) and, where the layer passes a
  ``sliding_window``, within it (``masking_utils.sliding_window_overlay``: ``k > q - window``);
* the model's own attention then runs on the rank's queries against the global keys with that
  mask: transformers' ``sdpa_attention_forward``, or the modeling file's ``eager_attention_forward``
  where the layer passes what SDPA cannot express (a logit ``softcap``), with the layer's own
  scaling, dropout and GQA grouping.

transformers builds no mask of its own for an implementation it has no mask function for
(``masking_utils._preprocess_mask_arguments`` exits early), so nothing is built twice. The shard of
the step (this rank's positions, the window's position ids, the cp group) is set around each
micro-step's forward *and* backward by ``context_parallel``, so the recompute of an activation-
checkpointed block finds it too. torch's own ``context_parallel()`` is not the base: it runs only
CUDA SDPA kernels and takes no mask.

``parallel.cp_attention: ulysses`` runs the same attention the other way round (``ulysses.py``):
heads instead of keys exchanged, by all-to-all, each rank attending whole windows for ``heads / cp``
of the heads with the window's whole mask.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from shardlm.data.context_split import chunk_index
from shardlm.errors import ConfigError
from shardlm.parallel.model.geometry import read_geometry
from shardlm.parallel.model.hf import is_depthwise_conv
from shardlm.parallel.runtime.ulysses import ATTENTION as ULYSSES
from shardlm.parallel.runtime.ulysses import heads_to_window, ulysses_refusal, window_to_heads

IMPLEMENTATION = "shardlm_context_parallel"
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
ATTENTION_DROPOUTS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")  # config names


@dataclass
class ContextShard:
    """One micro-batch as rank ``rank`` of the ``cp`` ranks of ``group`` holds it. ``positions``: the
    window's global position ids ``[batch, seq_len]``; ``attention``: ``parallel.cp_attention``;
    ``masks``: built once per micro-batch, per sliding window (the recompute of a checkpointed block
    reuses them)."""

    positions: torch.Tensor
    cp: int
    rank: int
    group: dist.ProcessGroup
    attention: str = "all_gather"
    masks: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        seq_len, device = self.positions.shape[1], self.positions.device
        self.index = chunk_index(seq_len, self.cp, self.rank, device)  # this rank's window positions
        # the window positions of every rank's tokens, rank by rank (the order collectives concatenate them in)
        self.gathered = torch.cat([chunk_index(seq_len, self.cp, r, device) for r in range(self.cp)])
        self.order = torch.argsort(self.gathered)  # the gathered rows -> window order

    def mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[batch, 1, local, seq_len]`` in ``dtype`` (0 where this rank's query attends to
        the key, the dtype's min elsewhere), built once and shared by every layer: handed a bool mask,
        SDPA converts it to a float one in each layer and saves that for the backward, one
        ``local x seq_len`` matrix a layer; this one is saved once. Under Ulysses: every row,
        ``[batch, 1, seq_len, seq_len]`` (its queries are the whole window)."""
        whole = self.attention == ULYSSES
        if (sliding_window, dtype, whole) not in self.masks:
            rows = torch.arange(self.positions.shape[1], device=self.positions.device) if whole else self.index
            allowed = document_mask(self.positions, rows, sliding_window)
            additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            self.masks[sliding_window, dtype, whole] = additive.masked_fill_(~allowed, torch.finfo(dtype).min)
        return self.masks[sliding_window, dtype, whole]


def document_mask(positions: torch.Tensor, index: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """The rows ``index`` of the document-causal (and sliding-window) mask of windows whose position
    ids are ``positions`` ``[batch, seq_len]``: a new document starts wherever a position is not its
    predecessor's plus one (transformers' rule for packed sequences)."""
    batch, seq_len = positions.shape
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    document = (step != 1).cumsum(-1)  # [batch, seq_len]
    q, k = index.view(-1, 1), torch.arange(seq_len, device=positions.device).view(1, -1)
    allowed = k <= q
    if sliding_window is not None:
        allowed = allowed & (k > q - sliding_window)
    same = document[:, index].unsqueeze(-1) == document.unsqueeze(-2)  # [batch, local, seq_len]
    return (allowed.unsqueeze(0) & same).unsqueeze(1)


_active: list[ContextShard] = []


@contextmanager
def context_parallel(shard: ContextShard | None):
    """Run the enclosed forward and backward on ``shard`` (None: no context parallelism)."""
    if shard is None:
        yield
        return
    _active.append(shard)
    try:
        yield
    finally:
        _active.remove(shard)


class _Recompute:
    """Enters ``shard`` unless it is already the active one; reusable (under a split backward, the input and
    the weight pass each recompute the block under the same context)."""

    def __init__(self, shard: ContextShard | None) -> None:
        self.shard, self.pushed = shard, []

    def __enter__(self):
        push = self.shard is not None and not (_active and _active[-1] is self.shard)
        if push:
            _active.append(self.shard)
        self.pushed.append(push)
        return self

    def __exit__(self, *exc):
        if self.pushed.pop():
            _active.remove(self.shard)
        return False


def recompute_context() -> _Recompute:
    """For ``torch.utils.checkpoint``'s ``context_fn``, called in a checkpointed block's forward: a context
    that runs the block's recompute on the shard the forward ran on. Without stages the micro-step's
    backward is inside ``context_parallel`` anyway; under ``parallel.pp`` the schedule runs the backward
    outside the stage's forward that held the shard, so the recompute must bring it back."""
    return _Recompute(_active[-1] if _active else None)


def gather_sequence(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``x`` ``[batch, heads, local, dim]`` of every cp rank, in window order ``[batch, heads, seq_len, dim]``;
    the backward reduce-scatters the gradient (each rank gets the sum over ranks of its rows')."""
    rows = x.transpose(0, 2).contiguous()  # the sequence first: the all-gather concatenates dim 0
    gathered = funcol.all_gather_single_autograd(rows, 0, shard.group)
    gathered = funcol.wait_tensor(gathered) if isinstance(gathered, funcol.AsyncCollectiveTensor) else gathered
    return gathered[shard.order].transpose(0, 2)


def context_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The registered attention function (see the module docstring); ``attention_mask`` is None:
    transformers builds none for this implementation."""
    if not _active:
        raise RuntimeError(f"{IMPLEMENTATION}: attention ran outside a context-parallel micro-step")
    shard = _active[-1]
    if kwargs.get("s_aux") is not None:  # refused before spawning (``context_parallel_refusal``); never dropped
        raise RuntimeError(f"{IMPLEMENTATION}: attention sinks (s_aux) are not supported under context parallelism")
    if shard.attention == ULYSSES:
        return ulysses_attention(module, query, key, value, shard, **kwargs)
    key, value = gather_sequence(key, shard), gather_sequence(value, shard)
    return model_attention(module, query, key, value, shard.mask(kwargs.get("sliding_window"), query.dtype), **kwargs)


def model_attention(module: nn.Module, query, key, value, mask: torch.Tensor, **kwargs):
    """The model's own attention with ``mask``: transformers' SDPA function, or the modeling file's eager
    one where the layer passes a logit ``softcap`` SDPA cannot express."""
    if kwargs.get("softcap") is None:
        return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, mask, **kwargs)


def ulysses_attention(module: nn.Module, query, key, value, shard: ContextShard, **kwargs):
    """Attention with heads exchanged for tokens (``ulysses.py``): whole windows, ``heads / cp`` heads.
    Attention dropout (refused before spawning) would need masks keyed by whole-window queries of a
    head slice; per-head extras (``position_bias``) would need slicing to the head group: both refused."""
    if kwargs.get("dropout"):
        raise RuntimeError(f"{IMPLEMENTATION}: attention dropout is not supported with cp_attention={ULYSSES}")
    if kwargs.get("position_bias") is not None:
        raise RuntimeError(f"{IMPLEMENTATION}: a per-head position_bias is not supported with cp_attention={ULYSSES}")
    cp, group = shard.cp, shard.group
    query, key, value = (heads_to_window(x, cp, shard.order, group) for x in (query, key, value))
    mask = shard.mask(kwargs.get("sliding_window"), query.dtype)  # every row: the queries are the whole window
    output, _ = model_attention(module, query, key, value, mask, **kwargs)
    return window_to_heads(output, cp, shard.gathered, group), None


AttentionInterface.register(IMPLEMENTATION, context_attention)


def enable_context_parallel(model: nn.Module) -> None:
    """Route every attention layer of ``model`` through ``context_attention``."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for config in configs.values():
        config._attn_implementation = IMPLEMENTATION


def _uses_attention_interface(cls: type) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def context_parallel_refusal(model: nn.Module) -> str | None:
    """Why ``model`` (meta is fine) cannot run under ``parallel.cp``, or None when it can."""
    name = type(model).__name__
    if not getattr(type(model), "_supports_context_parallel", True):
        return f"{name} declares it cannot run under context parallelism (transformers' _supports_context_parallel)"
    if "position_ids" not in inspect.signature(type(model).forward).parameters:
        return f"{name}'s forward takes no position_ids, so a rank's chunk cannot keep its positions"
    mixers = sorted({type(m).__name__ for m in model.modules() for c in m.children() if is_depthwise_conv(c)})
    config = model.config.get_text_config()
    layer_types = set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES)
    if mixers or layer_types:
        what = mixers[0] if mixers else sorted(layer_types)[0]
        return f"{name}'s {what} carries a recurrent state along the sequence, which cp ranks do not exchange"
    if getattr(config, "attention_chunk_size", None):
        return f"{name} uses chunked attention, whose mask context parallelism does not build"
    attention = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
    others = [a for a in attention if not _uses_attention_interface(_class_named(model, a))]
    if not attention or others:
        what = others[0] if others else "its attention"
        return f"{name}'s {what} does not dispatch through transformers' AttentionInterface"
    sinks = [a for a in attention if _has_sinks(_class_named(model, a))]
    if sinks:  # transformers' sdpa function takes s_aux in **kwargs and ignores it: it would be dropped
        return f"{name}'s {sinks[0]} adds attention sinks to the scores, which the context-parallel attention does not"
    return None


def _has_sinks(cls: type) -> bool:
    """Whether attention ``cls`` hands per-head sinks to the attention function (gpt-oss, Granite-SWA, ...)."""
    try:
        return "s_aux" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _class_named(model: nn.Module, name: str) -> type:
    return next(type(m) for m in model.modules() if type(m).__name__ == name)


def ulysses_model_refusal(model: nn.Module, cp: int, tp: int) -> str | None:
    """Why ``model`` cannot run ``parallel.cp_attention: ulysses`` at ``cp`` x ``tp``, or None: its
    heads after TP's split divide by cp (``ulysses.py``), and no attention dropout (its masks would be
    drawn on a head slice of whole windows, which ``DeterministicDropout`` does not key yet)."""
    config = model.config.get_text_config()
    geometry = read_geometry(config)
    why = ulysses_refusal(geometry.heads or 0, geometry.kv or 0, tp, cp)
    if why is not None:
        return f"{type(model).__name__}: {why}"
    dropout = next((name for name in ATTENTION_DROPOUTS if getattr(config, name, 0) or 0), None)
    if dropout is not None:
        value = getattr(config, dropout)
        return f"{type(model).__name__}'s attention dropout ({dropout}={value}) is not drawn per head slice yet"
    return None


def check_context_parallel(model: nn.Module, cp: int, attention: str = "all_gather", tp: int = 1) -> None:
    """Refuse ``parallel.cp`` > 1 for a model it cannot split (``shardlm.preflight``, and ``parallelize``);
    ``attention``: ``parallel.cp_attention``, whose Ulysses variant also needs heads dividing by cp."""
    if cp == 1:
        return
    why = context_parallel_refusal(model)
    if why is not None:
        raise ConfigError(f"parallel.cp={cp}: {why}; set parallel.cp: 1 (use parallel.tp or parallel.fsdp instead)")
    why = ulysses_model_refusal(model, cp, tp) if attention == ULYSSES else None
    if why is not None:
        raise ConfigError(
            f"parallel.cp={cp} with parallel.cp_attention={ULYSSES}: {why}; set parallel.cp_attention: all_gather"
        )
