"""The sizes of a hybrid model's recurrent mixers, read off its parameters, and what they save for
backward: the activation rows ``shardlm estimate`` counts for them (``mixer_elements``).

Why here: the estimator models attention and MLP blocks from the config; a linear-attention or
short-convolution mixer keeps very different tensors for backward (the depthwise convolution's
input and padded output, and for the delta rule the chunked per-head matrices and recurrent
states of transformers' torch path, ``torch_chunk_gated_delta_rule``), and their sizes are best
read where they live, in the mixer's own parameters:

* a **mixer** is the module holding a depthwise ``nn.Conv1d`` (weight ``[C, 1, K]``: ``C``
  channels, kernel ``K``; not the decoder blocks, which hybrids make of several classes);
* a **delta-rule** mixer (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo-hybrid) also holds a per-head
  decay ``A_log``: its ``H`` elements are the value heads; its gated norm per value head (the
  1-D weight beside the projections) gives the value head dim ``dv``; the convolution runs over
  q|k|v, so the key width is ``(C - H dv) / 2``, cut into heads of the config's
  ``linear_key_head_dim`` (the one size the parameters do not tell; else heads of ``H``);
* without ``A_log`` it is a **short convolution** (LFM2, LFM3): ``in_proj`` makes B, C and x of
  ``C`` channels each, the conv runs over ``B * x``, ``out_proj`` reads ``C * conv``.

Under TP a rank computes the heads (channels) it holds: everything below but the constant
terms is divided by ``t`` where the plan splits the conv (``per_channel``), as the mixer's
projections are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from shardlm.estimate.scans import ScanSizes, scan_elements, scan_sizes
from shardlm.parallel.model.hf import config_value, is_depthwise_conv

# transformers' torch fallback cuts the sequence in chunks of 64 (``torch_chunk_gated_delta_rule``)
DELTA_CHUNK = 64


@dataclass(frozen=True)
class MixerSizes:
    """One mixer: ``conv`` the fqn of its depthwise convolution, ``channels`` C and ``kernel`` K of
    it; a delta-rule mixer's ``heads`` (value heads, 0 for a short convolution), ``key_dim`` and
    ``value_dim`` per head, ``key_heads``."""

    fqn: str
    conv: str
    channels: int
    kernel: int
    heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    key_heads: int = 0
    scan: ScanSizes | None = None  # a state-space mixer (``estimate/scans.py``)


def _value_head_dim(mixer: nn.Module) -> int:
    """The width of the mixer's per-head norm: a 1-D ``weight`` outside its linears and convolutions."""
    widths = [
        m.weight.shape[0]
        for m in mixer.modules()
        if not isinstance(m, (nn.Linear, nn.Conv1d))
        and isinstance(getattr(m, "weight", None), nn.Parameter)
        and m.weight.dim() == 1
    ]
    return min(widths) if widths else 0


def _param(module: nn.Module, name: str) -> nn.Parameter | None:
    return next((p for n, p in module.named_parameters() if n.rpartition(".")[2] == name), None)


def mixer_sizes(model: nn.Module) -> list[MixerSizes]:
    """``MixerSizes`` of each mixer of ``model``: the modules holding a depthwise convolution; the
    state-space ones (Mamba, Mamba-2: a skip parameter ``D`` beside ``A_log``) with their
    ``scan_sizes``. Left out (the estimator counts it as attention): Kimi-Linear's delta attention
    (its decay per key channel: ``dt_bias`` wider than ``A_log``), another chunk path."""
    out = []
    for name, conv in model.named_modules():
        if not is_depthwise_conv(conv):
            continue
        fqn = name.rpartition(".")[0]
        mixer = model.get_submodule(fqn)
        channels, kernel = conv.weight.shape[0], conv.weight.shape[-1]
        decay, bias = _param(mixer, "A_log"), _param(mixer, "dt_bias")
        if decay is None:
            out.append(MixerSizes(fqn, name, channels, kernel))
            continue
        scan = scan_sizes(model.config, mixer, channels)
        if scan is not None:
            out.append(MixerSizes(fqn, name, channels, kernel, scan=scan))
            continue
        if bias is not None and bias.numel() != decay.numel():
            continue  # per-channel decay (Kimi-Linear): not modeled
        heads, value_dim = decay.numel(), _value_head_dim(mixer)
        key_width = (channels - heads * value_dim) // 2
        key_dim = config_value(model.config, "linear_key_head_dim") or key_width // heads
        out.append(MixerSizes(fqn, name, channels, kernel, heads, key_dim, value_dim, key_width // key_dim))
    return out


def mixer_elements(sizes: MixerSizes, batch: int, seq: int, tp: int, wide: int = 1, channels: int | None = None) -> int:
    """Elements one mixer saves for backward in a forward of ``batch`` x ``seq`` tokens on a rank
    holding ``1/tp`` of its channels (``tp`` 1 where the plan keeps it whole); its input (the norm's
    output, counted with the norm) left out. ``wide``: how many activation-dtype elements an fp32
    one is (2 under bf16): the delta rule's torch path casts to fp32 and runs in it. Per token and
    local channel/head (T = batch*seq, C, H: local channels, value heads; dk, dv: head dims; K:
    kernel)::

        short convolution:   T (3C + C + C)          in_proj's output (B, C, x), B*x, out_proj's input
                             + batch C (seq + K - 1)  the conv's padded output
        delta rule:          batch C (2 seq + K - 1)  the conv's input and padded output
                             + T (H + H dv)           beta; out_proj's input
                     fp32:   + T H (2 + 2)            the decay's softplus in and out, the L2 norms'
                                                      rstd of q and k
                             + 2 T H dk               q and k repeated to the value heads (in fp32
                                                      with as many key heads: T C, views of the
                                                      conv's activated output)
                             + T H (5 dv + 1)         the gated norm per value head
                             + batch H P (4 + 3 dv + 6 dk + 5c)  the chunked tensors
                             + batch H N (1 + dk dv)  per chunk its decay and the recurrent state

    where the sequence is padded to P = N c (chunks of c = 64; one fewer ``dk`` term when N = 1:
    the zero initial state needs no query saved). Left out: the c x c bool mask (c^2 bytes).
    A state-space mixer: ``scans.scan_elements``, with ``channels`` the rank's conv channels
    (the plan's rows of it; default ``C / tp``)."""
    t, T = tp, batch * seq
    if sizes.scan is not None:
        local = channels if channels is not None else sizes.channels // t
        return scan_elements(sizes.scan, sizes.kernel, local, batch, seq, t, wide)
    c = sizes.channels // t
    if not sizes.heads:
        return 5 * T * c + batch * c * (seq + sizes.kernel - 1)
    h, dk, dv = sizes.heads // t, sizes.key_dim, sizes.value_dim
    chunks = math.ceil(seq / DELTA_CHUNK)
    padded = chunks * DELTA_CHUNK
    per_chunk_row = 4 + 3 * dv + 6 * dk + 5 * DELTA_CHUNK - (dk if chunks == 1 else 0)
    qk = T * c if sizes.key_heads == sizes.heads and wide == 1 else wide * 2 * T * h * dk
    fp32 = (
        T * h * (4 + 5 * dv + 1)
        + batch * h * padded * per_chunk_row
        + batch * h * chunks * (1 + dk * dv)
        + 2 * h  # A_log's exp, twice
    )
    return batch * c * (2 * seq + sizes.kernel - 1) + T * h * (1 + dv) + qk + wide * fp32
