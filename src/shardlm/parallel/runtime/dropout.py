"""Dropout whose masks are the same in every layout: a hash of (seed, step, call site, position).

torch's dropout draws its mask from each process's RNG. Under tensor parallelism that breaks
training silently: the TP ranks of a group hold the *same* replicated activations (the residual
stream) but nothing makes their RNG states agree (a rank-0-only draw, a seed per rank), so each rank drops
different elements, the "replicated" activations and then the replicated parameters drift apart,
and a checkpoint keeps one rank's copy. DTensor's offset-based RNG would fix this on CUDA only
(torch 2.13 refuses CPU) and only for DTensor activations, which most of ours are not.

While training, ``DeterministicDropout`` (a ``TorchFunctionMode``) replaces ``F.dropout`` (so
``nn.Dropout`` too) and the dropout of ``F.scaled_dot_product_attention`` (attention then runs
as its math: scores, softmax, dropout, times values) by a counter-based mask: element ``e`` is
kept iff ``hash(seed, step, site, sample, index) >= p * 2**24`` (splitmix64), where

* ``site`` counts the dropout calls of one forward in call order (the model's code is the same
  in every layout); an activation-checkpointed block's recompute restarts from the count its
  forward had (``checkpoint_context_fn``), so it redraws exactly the same masks;
* ``sample`` is the sample's position in the *global* batch (dp rank and micro-step offsets),
  so data-parallel ranks draw different masks and one process draws the same ones;
* ``index`` is the element's index within its sample in the *unsharded* tensor: for a site the
  plan's trace found sharded across TP (attention probabilities of this rank's heads, an MLP
  intermediate), along dim ``d`` (``Plan.dropout_sites``), the local index is shifted to this
  rank's slice, so each shard draws its own part of the one-process mask.

Under context parallelism (``parallel/runtime/context.py``) a rank holds some of each sample's
tokens (``DropoutKey.sequence``: their positions in the window): the sequence coordinate of an
element is mapped to its window position, so each cp rank draws its tokens' part of the
one-process mask. The sequence dim is the query dim of attention probabilities (``[batch, heads,
queries, keys]``, the keys already gathered whole) and, for every other dropout, the first dim
after the batch whose size is the rank's token count (``[batch, seq, ...]`` activations).

Under sequence parallelism (``runtime/sequence.py``), a site the trace found replicated but run while
the residual stream is this rank's slice of the sequence (``in_sequence_region``) draws this rank's
positions of the one-process mask: its tensor is ``[batch, s / tp, ...]`` (or that flattened to
``[batch * s / tp, hidden]``) and index ``e`` is shifted to this rank's slice of dim 1. With context
parallelism too, that slice is of the cp rank's tokens: shifted to this tp rank's slice, then mapped to
its window positions.

The random draws of a forward in training (``call_sites.RANDOM_DRAWS``: a router's jitter, Mixtral's
``uniform_`` on its input, Phi-MoE's Gumbel sampling ``exponential_`` and ``rand_like``) are call sites
too, counted with the dropout calls and traced alike: their values come from the same hashes
(``hashed_draw``), so every TP rank draws the same noise for the replicated router, data-parallel
ranks their samples' part, and one process the whole (torch's RNG would give each rank its own).

Hence TP ranks agree on replicated activations, shards and dp ranks differ, and every layout
reproduces one process; the masks depend on nothing that a checkpoint would have to carry (the
step is part of the key), so a resumed run continues exactly. In evaluation (``training=False``)
dropout is the identity as usual. peft's LoRA dropout is covered too (``lora_dropout_sites``).
"""

from __future__ import annotations

import math
import zlib
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from shardlm.errors import ConfigError
from shardlm.parallel.plan.call_sites import drawn_size, dropout_args, is_call_site, is_random_draw, sdpa_args

_BITS = 24  # resolution of the keep test: p is rounded to a multiple of 2**-24


_M64 = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >= 1 << 63 else v


_C1, _C2, _GOLDEN = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps modulo 2**64)."""
    x = x ^ _srl(x, 30)
    x = x * _C1
    x = x ^ _srl(x, 27)
    x = x * _C2
    return x ^ _srl(x, 31)


def _mix_int(v: int) -> int:
    """The same finalizer on a Python int (exact), for the per-call salt."""
    v &= _M64
    v ^= v >> 30
    v = (v * 0xBF58476D1CE4E5B9) & _M64
    v ^= v >> 27
    v = (v * 0x94D049BB133111EB) & _M64
    return v ^ (v >> 31)


@dataclass
class DropoutKey:
    """What a micro-step's masks depend on. ``positions``: each local sample's index in the
    global batch; ``sites``: ``Plan.dropout_sites`` (empty at tp=1: nothing is sharded)."""

    seed: int
    step: int
    positions: torch.Tensor
    tp_rank: int = 0
    tp: int = 1
    sites: tuple = ()
    sequence: tuple[torch.Tensor, int] | None = None  # context parallelism: (this rank's window positions, seq_len)


def sequence_dim(shape: tuple[int, ...], key: DropoutKey) -> int | None:
    """Under context parallelism, the dim of a ``[batch, seq, ...]`` activation that holds this rank's
    tokens (None without); a tensor without one cannot be placed in the window."""
    if key.sequence is None:
        return None
    local = key.sequence[0].numel()
    for dim in range(1, len(shape)):
        if shape[dim] == local:
            return dim
    raise RuntimeError(
        f"dropout under context parallelism: a tensor of shape {list(shape)} has no dim of this rank's {local} tokens"
    )


def _window_index(shape: tuple[int, ...], key: DropoutKey, dim: int | None, seq_dim: int) -> tuple[torch.Tensor, int]:
    """Every local element's flat index in the one-process tensor (TP slice along ``dim`` and this cp
    rank's window positions along ``seq_dim`` put back), and that tensor's numel."""
    positions, seq_len = key.sequence
    full = list(shape)
    rest = torch.arange(math.prod(shape), device=positions.device, dtype=torch.int64)
    coords = []
    for size in reversed(shape):
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    if dim is not None and key.tp > 1:
        coords[dim] = coords[dim] + key.tp_rank * shape[dim]
        full[dim] = shape[dim] * key.tp
    coords[seq_dim] = positions.to(torch.int64)[coords[seq_dim]]
    full[seq_dim] = seq_len
    flat = torch.zeros_like(coords[0])
    for coord, size in zip(coords, full):
        flat = flat * size + coord
    return flat, math.prod(full)


_region = {"sequence": False}  # whether the residual stream is now this rank's slice of the sequence
SEQUENCE = "sequence"  # the dim of a site sharded over the sequence, whatever the tensor's rank


def set_sequence_region(on: bool) -> None:
    """Called by the sequence-parallel hooks (``runtime/sequence.py``) as the stream enters its slices
    (a block's input, a row-parallel output) and leaves them (a gathered sub-block, a block's output)."""
    _region["sequence"] = on


def in_sequence_region() -> bool:
    return _region["sequence"]


def traced_dim(key: DropoutKey, site: int) -> int | str | None:
    """The sharded dim of counted call ``site`` (``Plan.dropout_sites``); None when replicated."""
    if key.tp == 1:
        return None
    if site >= len(key.sites):
        raise RuntimeError(
            f"dropout call #{site + 1} of this forward was not seen when the TP plan was traced "
            f"({len(key.sites)} calls); its masks cannot be placed"
        )
    if key.sites[site] == -1:
        raise RuntimeError(f"dropout call #{site + 1}: its input is sharded across TP along no single dim")
    if key.sites[site] is None and in_sequence_region():
        return SEQUENCE
    return key.sites[site]


def element_hashes(
    shape: tuple[int, ...],
    key: DropoutKey,
    site: int,
    device,
    dim: int | str | None,
    seq_dim: int | None = None,
) -> torch.Tensor:
    """int64 hash of (seed, step, site, sample, index) of every element of a local tensor of ``shape``
    at call ``site``, sharded across TP along ``dim`` (None: replicated; ``SEQUENCE``: this rank's slice
    of every sample's positions, the tensor seen as ``[batch, s / tp, last dim]``) and, under context
    parallelism, holding this rank's tokens along ``seq_dim``: the one-process tensor's hashes at
    the elements this rank holds."""
    if dim == SEQUENCE:
        batch, numel = key.positions.numel(), math.prod(shape)
        if batch == 0 or numel % (batch * shape[-1]):
            raise RuntimeError(f"dropout: a tensor of shape {list(shape)} is not [batch, sequence slice, ...]")
        sliced = (batch, numel // (batch * shape[-1]), shape[-1])
        # under context parallelism too: the slice is of this rank's window positions (dim 1 both)
        return element_hashes(sliced, key, site, device, 1, None if key.sequence is None else 1).view(shape)
    numel = math.prod(shape)
    flat = torch.arange(numel, device=device, dtype=torch.int64)
    total = numel
    if seq_dim is not None:
        flat, total = _window_index(shape, key, dim, seq_dim)
        flat = flat.to(device)
    elif dim is not None and key.tp > 1:  # this rank holds slice tp_rank of dim `dim`: index it in the full tensor
        inner = math.prod(shape[dim + 1 :])
        block = shape[dim] * inner
        flat = (flat // block) * (block * key.tp) + key.tp_rank * block + flat % block
        total = numel * key.tp
    batch = key.positions.numel()
    if batch == 0 or total % batch:
        raise RuntimeError(
            f"dropout: a tensor of shape {list(shape)} does not split into the micro-batch's {batch} samples; "
            "shardlm's dropout needs batch-first activations"
        )
    per_sample = total // batch
    salt = _signed(_mix_int(_mix_int(_mix_int(key.seed) + key.step) + site))
    sample_keys = _mix(key.positions.to(device=device, dtype=torch.int64) * _GOLDEN + salt)
    return _mix(sample_keys[flat // per_sample] + (flat % per_sample) * _GOLDEN).view(shape)


def keep_mask(
    shape: tuple[int, ...],
    p: float,
    key: DropoutKey,
    site: int,
    device,
    dim: int | str | None,
    seq_dim: int | None = None,
) -> torch.Tensor:
    """Bool mask of the elements kept (``element_hashes``' arguments): a hash's top 24 bits against ``p``."""
    h = element_hashes(shape, key, site, device, dim, seq_dim)
    return _srl(h, 64 - _BITS) >= round(p * (1 << _BITS))


def hashed_dropout(
    x: torch.Tensor,
    p: float,
    key: DropoutKey,
    site: int,
    dim: int | str | None,
    inplace: bool = False,
    probs: bool = False,
) -> torch.Tensor:
    """``F.dropout(x, p, training=True)`` with the mask of ``keep_mask``; ``probs``: ``x`` is
    attention probabilities (under context parallelism their query dim holds this rank's tokens)."""
    if isinstance(x, DTensor):
        if not all(pl.is_replicate() for pl in x.placements):
            raise RuntimeError(f"dropout on a DTensor with placements {x.placements} is not supported")
        local = hashed_dropout(x.to_local(), p, key, site, dim, inplace, probs)
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)
    if p >= 1.0:
        return x.zero_() if inplace else torch.zeros_like(x)
    if dim == SEQUENCE:  # the slice of the sequence (of this cp rank's tokens): placed by ``keep_mask``
        seq_dim = None
    elif probs:
        seq_dim = x.dim() - 2 if key.sequence is not None else None
    else:
        seq_dim = sequence_dim(tuple(x.shape), key)
    with torch.no_grad():
        scale = keep_mask(tuple(x.shape), p, key, site, x.device, dim, seq_dim).to(x.dtype) * (1.0 / (1.0 - p))
    return x.mul_(scale) if inplace else x * scale


_MANTISSA = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}


def _draw_view(shape: tuple[int, ...], key: DropoutKey, dim: int | str | None) -> tuple[tuple[int, ...], object]:
    """The shape a draw is keyed in, and its TP dim there: under context parallelism a router's
    ``[batch * tokens, ...]`` (the tokens flattened) is seen as ``[batch, tokens, rest]``."""
    if key.sequence is None or not shape:
        return shape, dim
    batch, local = key.positions.numel(), key.sequence[0].numel()
    if local in shape[1:] or shape[0] != batch * local:
        return shape, dim
    return (batch, local, math.prod(shape[1:])), (2 if isinstance(dim, int) else dim)


_SECOND_STREAM = 1 << 40  # ``randn``'s second uniform stream: a site no forward reaches


def _unit(x: torch.Tensor, key: DropoutKey, site: int, dim: int | str | None, bits: int, half: bool) -> torch.Tensor:
    """fp64 values of ``x``'s shape on a grid of ``2**-bits`` in [0, 1) (``half``: the grid's midpoints,
    in (0, 1)) from the element hashes of call ``site``: each rank's part of the one-process draw."""
    shape, view_dim = _draw_view(tuple(x.shape), key, dim)
    seq_dim = sequence_dim(shape, key)
    h = element_hashes(shape, key, site, x.device, view_dim, seq_dim)
    return ((_srl(h, 64 - bits).to(torch.float64) + (0.5 if half else 0.0)) * 2.0**-bits).view(x.shape)


def hashed_draw(func, args: tuple, kwargs: dict, key: DropoutKey, site: int, dim: int | str | None) -> torch.Tensor:
    """A random draw of ``call_sites.RANDOM_DRAWS`` from the hashes of call ``site`` (``element_hashes``):
    ``rand_like`` and ``uniform_(low, high)`` on the draw's dtype's grid, ``exponential_(lambd)`` as
    ``-log(u) / lambd`` of fp64 midpoints (never 0, so Phi-MoE's Gumbel ``log`` stays finite), ``randn``
    by Box-Muller from two such streams (the second keyed by ``site`` offset past every call site's)."""
    if func is torch.randn:
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        like = torch.empty(drawn_size(args, kwargs), dtype=torch.float64, device=kwargs.get("device"))
        radius = torch.sqrt(-2.0 * torch.log(_unit(like, key, site, dim, 53, True)))
        angle = 2.0 * math.pi * _unit(like, key, site + _SECOND_STREAM, dim, 53, True)
        return (radius * torch.cos(angle)).to(dtype)
    x = args[0]
    if isinstance(x, DTensor):
        if not all(pl.is_replicate() for pl in x.placements):
            raise RuntimeError(f"a random draw on a DTensor with placements {x.placements} is not supported")
        local = hashed_draw(func, (x.to_local(), *args[1:]), kwargs, key, site, dim)
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)
    if func is torch.rand_like:
        dtype = kwargs.get("dtype") or x.dtype
        like = x if kwargs.get("device") is None else x.to(kwargs["device"])
        return _unit(like, key, site, dim, _MANTISSA.get(dtype, 24), False).to(dtype)
    with torch.no_grad():
        if func is torch.Tensor.uniform_:
            low = args[1] if len(args) > 1 else kwargs.get("from", 0.0)
            high = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
            u = _unit(x, key, site, dim, _MANTISSA.get(x.dtype, 24), False)
            return x.copy_(low + (high - low) * u)
        lambd = args[1] if len(args) > 1 else kwargs.get("lambd", 1.0)
        return x.copy_(-torch.log(_unit(x, key, site, dim, 53, True)) / lambd)


def _attention(a: dict, drop) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as its math, with ``drop`` on the probabilities."""
    q, k, v = a["query"], a["key"], a["value"]
    if a["enable_gqa"] and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale
    length, source = q.shape[-2], k.shape[-2]
    if a["is_causal"]:
        causal = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    mask = a["attn_mask"]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return drop(probs) @ v


_active: list[DeterministicDropout] = []


class DeterministicDropout(TorchFunctionMode):
    """Replaces dropout while active (see the module docstring); ``site``: the next call's number.
    ``used`` tells afterwards whether any call dropped something (p > 0 in training)."""

    def __init__(self, key: DropoutKey, site: int = 0) -> None:
        super().__init__()
        self.key, self.site, self.used = key, site, False
        self.lora: tuple[int, bool] | None = None  # inside a LoRA dropout: (its site, input sharded)

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    def _next_site(self) -> int:
        self.site += 1
        return self.site - 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_call_site(func):
            return func(*args, **kwargs)
        if self.lora is not None and func is F.dropout:  # not counted: the trace ran without LoRA
            x, p, training, inplace = dropout_args(args, kwargs)
            if not training or p == 0.0:
                return func(*args, **kwargs)
            self.used = True
            site, sharded = self.lora
            return hashed_dropout(x, p, self.key, site, x.dim() - 1 if sharded else None, inplace)
        site = self._next_site()
        if is_random_draw(func):
            self.used = True
            return hashed_draw(func, args, kwargs, self.key, site, traced_dim(self.key, site))
        if func is F.dropout:
            x, p, training, inplace = dropout_args(args, kwargs)
            if not training or p == 0.0:
                return func(*args, **kwargs)
            self.used = True
            return hashed_dropout(x, p, self.key, site, traced_dim(self.key, site), inplace)
        a = sdpa_args(args, kwargs)
        p = a["dropout_p"]
        if p == 0.0:
            return func(*args, **kwargs)
        self.used = True
        dim = traced_dim(self.key, site)
        return _attention(a, lambda probs: hashed_dropout(probs, p, self.key, site, dim, probs=True))


def check_layerdrop(model_path: str) -> None:
    """Refuse LayerDrop (OPT's ``layerdrop``) on more than one process: each rank would skip
    decoder layers by its own ``torch.rand`` draw, so TP and FSDP ranks would run different layers
    (different collectives: a hang, or silently different models)."""
    from transformers import AutoConfig

    layerdrop = getattr(AutoConfig.from_pretrained(model_path), "layerdrop", 0.0)
    if isinstance(layerdrop, (int, float)) and layerdrop > 0:
        raise ConfigError(
            f"model: layerdrop={layerdrop} skips layers by each rank's own random draw, which desynchronizes "
            "the ranks; set layerdrop to 0 in config.json, or train on one process"
        )


def dropout_active() -> bool:
    """Whether a ``DeterministicDropout`` is in effect (``train/compile.py`` runs blocks eagerly then)."""
    return bool(_active)


def resume_at(site: int) -> None:
    """Number the active mode's next dropout call ``site``: a later pipeline stage entering its first block
    resumes the count one process's forward has there (``runtime/pipeline.py``); nothing without a mode."""
    if _active:
        _active[-1].site = site


def checkpoint_context_fn():
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant): the recompute of a block runs
    under a ``DeterministicDropout`` restarted at the site count the block's forward started from."""
    if not _active:
        return nullcontext(), nullcontext()
    mode = _active[-1]
    return nullcontext(), DeterministicDropout(mode.key, mode.site)


_LORA_SITES = 1 << 40  # LoRA sites are numbered apart from the counted ones


def lora_dropout_sites(model: nn.Module, plan=None, tp: int = 1) -> None:
    """Give peft's ``lora_dropout`` modules sites of their own: they are not in the plan's trace
    (it runs before peft wraps the model), so they take no count; their site is a hash of the
    adapted layer's FQN as shardlm names it (a ``PeftModel``'s ``base_model.model.`` prefix
    removed, so one-process peft draws the same masks). Their input is sharded on its last dim
    exactly when the layer is row-parallel (``plan``'s style at ``tp`` > 1)."""
    styles = plan.styles if plan is not None and tp > 1 else {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Dropout) or ".lora_dropout." not in f".{name}.":
            continue
        layer = name.split(".lora_dropout.")[0].removeprefix("base_model.model.")
        site = (_LORA_SITES + zlib.crc32(layer.encode()), styles.get(layer) == "rowwise")

        def enter(module, args, site=site):
            if _active:
                _active[-1].lora = site

        def leave(module, args, out):
            if _active:
                _active[-1].lora = None

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
