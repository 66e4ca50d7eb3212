"""Activation memory: what autograd keeps for backward, counted before anything runs (``activation_elements``).

Activations saved for backward, per decoder layer, in elements (T = batch*seq tokens per rank,
h hidden, a heads, k kv heads, d head dim, f intermediate, t = tp; no sequence parallelism,
flash/SDPA attention, so no T*seq score matrix)::

    T * (6h + 2                   per RMSNorm (replicated over TP): input, normalized input,
                                  output (the next linear's input), rstd
         + (a + 2k) d / t         q, k (after RoPE) and v, kept by attention (k < t: a d / t + 2 d,
                                  one replicated kv head per rank)
         + a d / t                attention output (o_proj input)
         + 4 f / t                gate, act(gate), up, act*up (down_proj input)
         + a / t)                 attention logsumexp

A mixture-of-experts layer (``moe.moe_sizes``: E experts of width I, in-projection width
``I_in`` = 2I for gate and up, top-k choices per token, shared-expert width ``s``) saves instead of
the MLP's ``4f/t``, as transformers' grouped-matmul kernel runs it::

    T * (E + 1                    router probabilities, top-k normalizer
         + k (I_in + 2I) / t      per (token, choice) pair: in-projection output, act(gate), the
                                  down projection's input (a non-gated expert: I_in + I)
         + k (2h + 10)            the pair's gathered input row and its down output (weighted by the
                                  router), sort permutations and indices (int64: 2 elements each)
         + 4 s / t                a shared expert, as a dense MLP
         + g (h + 2))             a 1-wide gate on its output (Qwen2-MoE): the output and the gate

Under EP a rank runs the pairs routed to its experts (its share when routing is balanced) and saves
a few more int64 indices per pair: measured on rank 0 of a 2-rank ep=2 run (experts dispatched,
the rest as one process), +1.2% (Mixtral) and +0.4% (Qwen2-MoE) of these activations, left out;
the all-to-all buffers (the rows sent, received and returned, ``3kh`` per token) live only during
a layer's forward or backward. Routing that sends a rank more than its share of the pairs is not
in it, nor per-head q/k norms (Qwen3, OLMoE).

A hybrid model's recurrent mixers (``estimate/mixers.py``: a module holding a depthwise
``Conv1d``, its sizes read off its parameters) save instead of attention's terms what
transformers' torch paths keep: for a short convolution (LFM2, LFM3) ``T*5C/t + batch*C/t*(seq +
K - 1)``; for Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid) the conv's input and padded output,
the gates, and the chunked tensors and per-chunk recurrent states of ``torch_chunk_gated_delta_rule``
(the sequence padded to chunks of 64: ``~batch*H/t*P*(6dk + 3dv + 5*64)``), which it computes in
fp32 whatever the activation dtype. Checked per mixer against autograd's saved tensors (fp32, one
process and per rank at tp=2): the same but for the delta rule's 4 KiB chunk mask; the whole Qwen3.5
text stack is 5.6% under (its attention layer's q/k norms and output gate). Under bf16 autocast the
delta rule's matmul operands are saved in bf16: the count is an upper bound there (+16% measured on
the tiny Qwen3.5 mixer). The state-space mixers (``estimate/scans.py``: Mamba-1 in Mamba,
Falcon-Mamba, Jamba; Mamba-2 in Mamba2, Nemotron-H, Bamba, Falcon-H1, GraniteMoE-hybrid) save what
transformers' torch scans keep: Mamba-1's sequential scan ``~3*batch*seq*C/t*n`` (per channel and
state: the discretized A and B, and the state at every step), Mamba-2's chunked one
``~batch*P*(H/t*(3c + 5n) + 5I/t)`` (P: the sequence padded to chunks of c), on a rank its rows of
the conv (``local_channels``: Mamba-2's B and C whole at ``n_groups < tp``). Checked per mixer
against autograd's saved tensors (fp32, one process and per rank at tp=2): equal to the byte but for
Mamba-2's bool masks (``2c^2 + 2(N+1)^2`` bytes); under bf16 autocast within -2% (Mamba-1), -3%
(Mamba-2) and -10% (Falcon-H1) on the tiny mixers. Not modeled: the fused kernels (fla,
causal-conv1d, mamba-ssm) on GPU, which save far less; Kimi-Linear's delta attention (a decay per
key channel, its own chunk path), counted as attention.
A sliced projection whose rows some ranks share (Mamba-2's ``in_proj`` with B and C held whole at
``n_groups < tp``) and the conv over it are stored whole; each rank copies its rows of their weights
in each forward and autograd keeps the copy (``row_copies``; not a bias's, which is only added).
Packed projections of unequal parts (Qwen3.5's ``in_proj_qkv``) are split like any other: no copy.

With sequence parallelism (``sequence_parallel``, ``parallel/plan/sequence.py``) each norm computes on
the rank's slice of the sequence and its output is gathered whole for the column-parallel layers,
which keep that gathered input: per norm ``T*(2h + 1)/t + T*h`` instead of ``T*(3h + 1)``; the rest
of a layer is as without it (attention and the MLP run on the whole sequence, split by heads and
columns); the final norm runs on the slices too where nothing but it has parameters outside the blocks
(``stream_ends``; its output gathered for the LM head), else on the whole sequence (GPT-2, OPT: the stream is
gathered after the last block).

Under context parallelism (``cp``) T is the rank's ``batch*seq/cp`` tokens, but attention keeps
the keys and values of the whole window, repeated to every query head where the kv heads are fewer
(SDPA given a mask has no GQA path): ``T*(2ad/t + a/t) + 2*cp*T*w`` per layer (``w``: ``ad/t``
repeated, else ``kd/t``), and the additive mask of the rank's rows, ``batch*seq/cp*seq`` in the
activations' dtype, once for every full-attention layer and once for the sliding-window ones
(``context_attention_elements``, ``context_mask_elements``; ``parallel/runtime/context.py``). With
``cp_attention="ulysses"`` (``parallel/runtime/ulysses.py``) a rank attends the whole window for
``a/cp`` of its heads: the same ``T*(2ad/t + a/t)`` for queries, output and logsumexp, keys and values
``2*T*w`` (``seq x w/cp``), and the mask has every row, ``batch*seq*seq``. With
sequence parallelism too, the norms' terms above are on the slices of those ``T`` tokens (measured
within 0.5% at tp=2 x cp=2, seq 8768: ``benchmarks/long_sequence_tables.py``).

With gradient checkpointing only each layer's input ``T*h`` stays (``T*h/t`` under sequence
parallelism), plus one layer's activations while it is recomputed. The final norm adds
``T*(3h + 1)``. Checked against the tensors autograd really saves (``saved_tensors_hooks``) in
``tests/test_estimate.py``. Logits: ``T*vocab/t`` fp32 and their gradient. ``bf16`` is shardlm's
mixed precision (``train.bf16``): fp32 master weights, gradients and Adam states, activations in 2
bytes but what the modeling code keeps in fp32 (``norm_elements``): an RMSNorm upcasts its input and
keeps it and its rstd in fp32; under autocast (no FSDP: fp32 weights) the residual stream and the
normalized input are fp32 too and each linear reading a norm's output keeps its own bf16 cast of it
(q, k and v three), where FSDP2's bf16 weights (``param_dtype``) keep one. A LoRA run's frozen base
keeps less: no input of a frozen linear (the MLP's product; a frozen MLP reads its norm's output
for nothing), no normalized input of a frozen norm; under autocast each adapter keeps its own bf16
copy of its input (peft casts it to the adapter's fp32 first). Within 10% of the saved tensors at
tp=2, tp=2 + SP and cp=2, bf16 full and LoRA (``tests/test_estimate.py``).
"""

from __future__ import annotations

import functools

from shardlm.estimate.moe import MoeSizes, moe_elements
from shardlm.estimate.params import LORA_TARGETS
from shardlm.parallel.model.geometry import read_geometry
from shardlm.parallel.runtime.ulysses import ATTENTION as ULYSSES

# how the activations are computed (``activation_elements``): fp32; bf16 under autocast (``train.bf16`` without
# FSDP: fp32 weights and residual stream, each linear's input cast); bf16 weights (FSDP2's param_dtype)
AUTOCAST = "autocast"
PRECISIONS = ("fp32", AUTOCAST, "bf16")


def text_dims(config) -> dict[str, int]:
    """The sizes the formulas use, under the names of ``hf.CONFIG_NAMES``; no attention heads (a
    pure state-space model: Mamba, Falcon-Mamba, Mamba2) counts none."""
    geo = read_geometry(config)
    h, a = geo.hidden, geo.heads or 0
    return {
        "h": h,
        "a": a,
        "k": geo.kv_heads or a,
        "d": geo.head_dim or 0,
        "f": geo.intermediate or 4 * h,
        "L": geo.layers,
        "V": geo.vocab,
    }


def activation_elements(
    config,
    tokens: int,
    tp: int,
    checkpointing: bool,
    lora_r: int | None = None,
    moe: list[MoeSizes] = (),
    mixers: list[int] = (),
    sequence_parallel: bool = False,
    cp: int = 1,
    in_flight: int = 1,
    final_norm: bool = True,
    cp_attention: str = "all_gather",
    sliced_final_norm: bool = False,
    precision: str = "fp32",
) -> int:
    """Elements saved for backward by the decoder stack (see the module docstring); ``moe``: the
    model's mixture-of-experts layers (``moe.moe_sizes``), the other layers dense; ``mixers``:
    the elements of each recurrent mixer (``mixers.mixer_elements``), in place of attention
    in as many layers; ``sequence_parallel``: the norms on sequence slices; ``cp``: context
    parallelism, ``tokens`` this rank's, ``cp_attention`` its variant (``context_attention_elements``). A
    pipeline stage (``estimate/stages.py``): ``config`` its own (its blocks), ``in_flight`` micro-batches of
    ``tokens`` held at once (with activation checkpointing their inputs, and one block recomputed),
    ``final_norm`` on the last stage only, on sequence slices (``sliced_final_norm``) where the stream stays in
    them up to the LM head (``plan.sequence.stream_ends``). ``precision`` (``PRECISIONS``): what the norms keep
    in fp32 under bf16, counted in 2-byte elements (``norm_elements``)."""
    g = text_dims(config)
    h, a, k, d, f, t = g["h"], g["a"], g["k"], g["d"], g["f"], tp
    local_kv = k // t if k % t == 0 else 1  # fewer kv heads than tp: each rank computes one (replicated)
    lora, cast = bool(lora_r), precision == AUTOCAST
    # two norms: the attention's, read by q, k, v (or their adapters); the MLP's, by gate and up (frozen under LoRA)
    norm = functools.partial(norm_elements, tokens, h, t if sequence_parallel else 1, precision, not lora)
    norms = norm(3 if cast else 1) + norm(0 if lora else 2 if cast else 1)
    inputs = g["L"] * tokens * h // (t if sequence_parallel else 1)  # kept by activation checkpointing
    attention = tokens * (a * d // t + 2 * local_kv * d + a * d // t + a // t)
    if cp > 1:
        attention = context_attention_elements(tokens, cp, a // t, local_kv, d, cp_attention == ULYSSES)
    if lora_r:  # x @ A of each adapter; under autocast o_proj's adapter its own copy of its input (peft's fp32 cast)
        attention += tokens * lora_r * len(LORA_TARGETS) + (tokens * a * d // t if cast else 0)
    mixing = [norms + attention] * (g["L"] - len(mixers)) + [norms + m for m in mixers]
    dense = tokens * ((3 if lora else 4) * f // t)  # gate, up, act(gate), product: down's input (frozen: not kept)
    mlps = [dense] * (g["L"] - len(moe)) + [moe_elements(config, sizes, tokens, tp) for sizes in moe]
    stack = in_flight * inputs + max(mixing) + max(mlps) if checkpointing else in_flight * (sum(mixing) + sum(mlps))
    final = norm_elements(tokens, h, t if sliced_final_norm else 1, precision, not lora, 0 if lora else 1)
    return stack + (in_flight * final if final_norm else 0)


def norm_elements(tokens: int, h: int, slices: int, precision: str, trained: bool, copies: int) -> int:
    """What one norm keeps for backward, in the activations' dtype (an fp32 tensor 2 elements under bf16),
    measured on Llama's RMSNorm (``tests/test_estimate.py``): on its ``slices`` of the sequence (tp under
    sequence parallelism) its input (fp32 under bf16: the norm upcasts it, autocast's residual stream is
    fp32 already), the normalized input where its weight trains (fp32 under autocast, where it is multiplied
    by an fp32 weight; in the compute dtype otherwise) and the rstd; whole, ``copies`` of its output, kept by
    the linears reading it (autocast casts it once per reading linear; none where every reader is frozen)."""
    wide = 1 if precision == "fp32" else 2
    normalized = (wide if precision == AUTOCAST else 1) * h if trained else 0
    return tokens * (wide * h + normalized + wide) // slices + tokens * h * copies


def context_attention_elements(tokens: int, cp: int, heads: int, kv_heads: int, d: int, ulysses: bool = False) -> int:
    """One attention layer's saved elements on a context-parallel rank of ``tokens`` tokens
    (``parallel/runtime/context.py``): its queries, output and logsumexp, and the keys and values
    of the whole window (``cp x tokens``), repeated to every query head where the kv heads are
    fewer (SDPA given a mask runs no GQA kernel: transformers repeats them). ``ulysses``: the whole
    window for ``1/cp`` of the heads instead (``parallel/runtime/ulysses.py``), as many queries and
    outputs, keys and values ``tokens x width``."""
    width = heads * d if kv_heads < heads else kv_heads * d
    return tokens * (2 * heads * d + heads) + 2 * (1 if ulysses else cp) * tokens * width


def context_mask_elements(config, batch: int, seq: int, cp: int, cp_attention: str = "all_gather") -> int:
    """The additive masks a context-parallel rank holds for a micro-batch, ``batch x seq/cp x seq``
    each (``seq x seq`` under Ulysses: its queries are the whole window), in the activations' dtype:
    one for full attention, one for a sliding window (shared by every layer of its kind)."""
    if cp == 1:
        return 0
    text = config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"]) & {"full_attention", "sliding_attention"}
    rows = seq if cp_attention == ULYSSES else seq // cp
    return max(len(kinds), 1) * batch * rows * seq
