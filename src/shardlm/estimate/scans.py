"""The sizes of a state-space mixer (Mamba-1, Mamba-2), read off its parameters, and the tensors
transformers' torch path saves for backward: the rows ``shardlm estimate`` counts for them.

Why a module of its own: a state-space mixer's scan keeps tensors of a shape no attention or
delta-rule term has (per channel and state for Mamba-1, per chunk and state for Mamba-2), and
their sizes live in the mixer's own parameters (``estimate/mixers.py`` finds the mixer, the
module holding a depthwise ``Conv1d``; a skip ``D`` beside ``A_log`` makes it a state-space one):

* **Mamba-1** (Mamba, Falcon-Mamba, Jamba): ``A_log`` is ``[C, n]``, C channels (the conv's) by n
  states; ``x_proj`` makes dt (rank r), B and C (n each) out of the C channels, so r is its width
  less 2n. Falcon-Mamba and Jamba normalize dt, B and C (three RMSNorms: children of the mixer
  other than its linears and conv; Jamba's have a weight, Falcon-Mamba's none).
* **Mamba-2** (Mamba2, Nemotron-H, Bamba, Falcon-H1, GraniteMoE-hybrid): ``A_log`` is ``[H]``, H
  heads; ``in_proj`` (its widest linear) makes the gate (I), the conv's channels (x: I, B and C:
  g n each) and dt (H), so I is its width less the conv's channels less H; the gated norm groups
  I in ``g`` groups. The parameters tell ``g n``, not g: g and the chunk length are the config's
  (``n_groups``, ``chunk_size`` under their names in ``hf.CONFIG_NAMES``).

Under TP a rank computes its heads (channels): ``scan_elements`` takes the rank's conv channels
(the plan's rows of it), so Mamba-2's B and C, held whole on every rank at ``n_groups < tp``,
count whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from shardlm.parallel.model.hf import config_size, config_value


@dataclass(frozen=True)
class ScanSizes:
    """``heads`` H (Mamba-2) or 0 (Mamba-1, one decay per channel and state); ``state`` n;
    ``rank`` r (Mamba-1's dt rank); ``inner`` I (Mamba-2's gate and x width); ``groups`` g and
    ``chunk`` (Mamba-2); ``norms``: Mamba-1's dt/B/C RMSNorms, 0 none, 1 weightless, 2 weighted;
    ``gated_norm``: Mamba-2's gated RMSNorm (else the gate multiplies the scan's output: Falcon-H1
    without ``mamba_rms_norm``); ``scaled_in``/``scaled_out``: the widths of in_proj's input and
    output where a multiplier scales them (Falcon-H1's ``ssm_in_multiplier`` and ``mup_vector``)."""

    heads: int
    state: int
    rank: int = 0
    inner: int = 0
    groups: int = 0
    chunk: int = 0
    norms: int = 0
    gated_norm: bool = True
    scaled_in: int = 0
    scaled_out: int = 0


def _linears(mixer: nn.Module) -> list[nn.Linear]:
    return [m for m in mixer.modules() if isinstance(m, nn.Linear)]


def scan_sizes(config, mixer: nn.Module, channels: int) -> ScanSizes | None:
    """``ScanSizes`` of ``mixer`` (its conv has ``channels``), None unless it holds ``A_log`` and ``D``."""
    params = {n.rpartition(".")[2]: p for n, p in mixer.named_parameters()}
    decay = params.get("A_log")
    if decay is None or "D" not in params:
        return None
    linears = _linears(mixer)
    if decay.dim() == 2:  # Mamba-1: [C, n]
        state = decay.shape[1]
        x_proj = next(m for m in linears if m.in_features == channels and m.out_features > 2 * state)
        norms = [m for m in mixer.children() if not isinstance(m, (nn.Linear, nn.Conv1d)) and hasattr(m, "weight")]
        weighted = 2 if any(isinstance(m.weight, nn.Parameter) for m in norms) else 1
        return ScanSizes(0, state, rank=x_proj.out_features - 2 * state, norms=weighted if norms else 0)
    heads = decay.numel()
    in_proj = max(linears, key=lambda m: m.out_features)
    inner = in_proj.out_features - channels - heads
    groups = config_size(config, "ssm_groups") or 1
    norms = [m for m in mixer.children() if not isinstance(m, (nn.Linear, nn.Conv1d))]
    return ScanSizes(
        heads,
        (channels - inner) // (2 * groups),
        inner=inner,
        groups=groups,
        chunk=config_size(config, "ssm_chunk") or 256,
        gated_norm=any(isinstance(getattr(m, "weight", None), nn.Parameter) for m in norms),
        # a buffer as wide as in_proj's output multiplies it; the config's scalar multiplies its input
        scaled_in=in_proj.in_features if config_value(config, "ssm_in_multiplier") is not None else 0,
        scaled_out=in_proj.out_features if any(b.numel() == in_proj.out_features for b in mixer.buffers()) else 0,
    )


def scan_elements(scan: ScanSizes, kernel: int, channels: int, batch: int, seq: int, tp: int, wide: int = 1) -> int:
    """Elements a state-space mixer saves for backward in a forward of ``batch`` x ``seq`` tokens
    on a rank holding ``1/tp`` of its heads (channels) and ``channels`` of its conv; its input (the
    norm's output) left out. fp32; per token (T = batch*seq, b = batch, s = seq; C, H, I, g:
    the rank's channels, heads, inner width and groups; n: states; K: kernel)::

        both:     T W + b C (s + K - 1)   in_proj's output (W wide: the conv reads a view of it),
                                          the conv's padded output
        Mamba-1:  + 2 C n                 exp(A_log) and A
                  + T (6C + r + 2n)       act(conv), x_proj's output (dt_proj reads a view), softplus
                                          in and out, the scan's output, silu(z), out_proj's input
                  + T C (batch > 1)       x_proj's input, copied out of the transposed act(conv)
                  + 2 T C n               exp(A dt) and dt B, per channel and state
                  + (s + 1) b C n         the recurrent state at each step (and the zero first one)
                  + T (3 + k (r + 2n))    dt/B/C norms: rstd, and k copies (k = 0, 1 weightless, 2)
        Mamba-2:  + 2 H + T (C + 3H)      exp(A_log), A; act(conv); softplus in, clamp in, dt
                  + b P (5I + 5Hn + 2H + 3Hc)      the chunked tensors (P = N c: the sequence
                  + b H ((N+1)^2 + (2N+1) p n)     padded to N chunks of c), the chunk states,
                  + T (4I + g)            the padded scan output; the gated norm (without one,
                                          T 2I: silu(gate) and the product)
                  + T h + W               Falcon-H1: in_proj's input, scaled (a copy); the
                                          ``mup_vector`` scaling its output (the conv reads the product)

    Left out: the segment sums' bool masks (2 c^2 + 2 (N+1)^2 bytes).

    ``wide``: how many activation-dtype elements an fp32 one is (2 under bf16). Under bf16 autocast
    the torch scans run partly in fp32 (``.float()``): Mamba-1's count is taken as fp32 whole
    (measured -2% on the tiny Mamba and Jamba mixers, 2 x 64 tokens, autocast's weight copies
    apart); Mamba-2's chunked terms outside its einsums (which autocast runs in bf16), the D skip
    and the gated norm as fp32, the rest in the activation dtype (measured -3% on Mamba2 and Bamba,
    -10% on Falcon-H1, whose fp32 ``mup_vector`` promotes in_proj's output)."""
    b, s, T, n = batch, seq, batch * seq, scan.state
    if not scan.heads:  # Mamba-1: the conv's channels are the mixer's
        c, r = channels, scan.rank
        return wide * (
            T * 2 * c
            + b * c * (s + kernel - 1)
            + 2 * c * n
            + T * (6 * c + r + 2 * n)
            + (T * c if b > 1 else 0)  # x_proj's input: a view of act(conv) at batch 1, else a copy
            + 2 * T * c * n
            + (s + 1) * b * c * n
            + (T * (3 + scan.norms * (r + 2 * n)) if scan.norms else 0)
        )
    h, inner = scan.heads // tp, scan.inner // tp
    p, g = inner // h, (channels - inner) // (2 * n)  # B and C: split by group, or whole (g < tp)
    width = inner + channels + h
    chunks = math.ceil(seq / scan.chunk)
    padded = chunks * scan.chunk
    # computed in fp32 whatever the activation dtype: the chunked tensors outside the einsums (the
    # padded x of the D skip and of the output, L, B, the decays), A, and the gated norm
    fp32 = (
        2 * h
        + b * padded * (2 * inner + h * n + 2 * h + h * scan.chunk)
        + b * h * (chunks + 1) ** 2
        + (T * (4 * inner + g) if scan.gated_norm else 2 * T * inner)
    )
    return (
        T * width
        + b * channels * (s + kernel - 1)
        + T * (channels + 3 * h)
        + b * padded * (3 * inner + 4 * h * n + 2 * h * scan.chunk)  # the einsums' operands
        + b * h * (2 * chunks + 1) * p * n
        + T * scan.scaled_in
        + (width if scan.scaled_out else 0)
        + wide * fp32
    )
