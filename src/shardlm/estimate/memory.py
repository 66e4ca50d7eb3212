"""Memory per rank of a training layout, before starting anything: ``shardlm estimate``.

Why: the first question about a layout is whether it fits, and the answer should not cost a
failed launch. Parameter shapes come from the meta model and the same TP plan ``parallelize``
applies (``autotp.infer_plan``), so the model-state numbers are what the ranks really hold:

* TP: ``colwise``/``packed_colwise``/``lm_head`` shard a weight's output dim, ``rowwise`` its
  input dim (its bias stays replicated), ``embedding`` the vocabulary rows (in torch's chunks: where tp
  does not divide the vocabulary, rank 0's are the most, and counted; ``Estimate.vocab_rows``); ``replicate`` and
  ``replicate_grad_allreduce`` (norms) are whole on every TP rank, and so are the plan's
  ``sliced`` projections (k/v when kv heads < tp, Phi-3's GQA qkv_proj).
* FSDP2 then chunks dim 0 of each TP-local tensor over ``fsdp`` (the largest chunk, rank 0's,
  is reported). ``dp_replicate`` holds full copies: it divides nothing.
* Gradients: one per trainable parameter, same local shape and dtype (fp32 master weights; the
  TP embedding's too: its rows only, ``parallel/runtime/embedding.py``). AdamW: two fp32 states per
  trainable parameter. With ``lora_r``, only the adapters train:
  ``r*(in+out)`` per targeted linear, A/B placed like their base (colwise base: B sharded;
  rowwise base: A sharded); under ``bf16`` the frozen base is stored in 2 bytes.

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

Under pipeline parallelism (``pp``, ``pipeline_estimate``) each stage is estimated on its own, cut as the
ranks cut it (``estimate/stages.py``): its parameters, its blocks' activations times the micro-batches
its schedule keeps in flight (``T`` one micro-batch's tokens), the final norm and logits on the last stage.

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
``compute_weights``: with FSDP, the gathered copies it computes with (root + two blocks with
prefetch, in the compute dtype); without FSDP under bf16, autocast's bf16 copy of every local weight
(cached for the forward, kept for the backward). ``reduce_scatter``: with FSDP, the unsharded fp32
gradients of one decoder block that FSDP2 fills before reducing them (the root's are filled at the
end of backward, when the activations are gone).

The peak is the larger of two phases: the step (the model state plus everything above, alive
at once at the start of backward: an upper bound, since activations are freed while gradients
are made) and the optimizer step (the model state plus ``optimizer_temporaries``: foreach AdamW
makes one fp32 temporary per trainable element, ``sqrt(exp_avg_sq)``). ``runtime`` is the
resident memory of a process that has imported torch and transformers, measured here and
printed on its own line: it is not in the total (on a GPU it is outside the allocator).
Measured against the peak RSS of real runs minus that baseline (``make bench-scale``,
``benchmarks/README.md``): +3.4% (349M Llama, tp2 x fsdp2), -6.5% (125M, tp2), -5.3% (349M,
fsdp2, activation checkpointing), with glibc's mmap threshold at 128 KiB, where freed tensors
went back to the OS at once; at the 8 MiB ``mesh.tune_cpu_allocator`` sets (a third faster a
step) the heap keeps about 9% more at the 349M step peak.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from torch import nn

from shardlm.config import ParallelConfig
from shardlm.config.paths import check_model_dir
from shardlm.config.ranges import check_value, check_world
from shardlm.config.schema import PP_SPLIT_BACKWARD
from shardlm.data.fit import check_seq_len, max_positions, model_config
from shardlm.distributed.mesh import resident_bytes
from shardlm.errors import ConfigError
from shardlm.estimate.mixers import mixer_elements, mixer_sizes
from shardlm.estimate.moe import MoeSizes, moe_elements, moe_sizes
from shardlm.estimate.stages import (
    bubble,
    check_microbatches,
    cut_stages,
    held_states,
    schedule_name,
    stages_per_rank,
)
from shardlm.parallel.infer.autotp import check_geometry, infer_plan
from shardlm.parallel.model.experts import experts_modules
from shardlm.parallel.model.geometry import read_geometry
from shardlm.parallel.model.hf import is_conv1d
from shardlm.parallel.model.meta import build_meta_model, decoder_blocks
from shardlm.parallel.plan.channels import param_rows
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.rows import chunk_rows, lead_dim
from shardlm.parallel.plan.sequence import sequence_refusal, stream_ends
from shardlm.parallel.plan.styles import Style, local_shape, lora_dims, sharded_dim
from shardlm.parallel.runtime.ep import check_ep
from shardlm.parallel.runtime.ulysses import ATTENTION as ULYSSES
from shardlm.parallel.runtime.ulysses import ulysses_refusal

DEFAULT_SEQ = 128  # tokens per sequence when --seq is not given (fewer when the model has fewer positions)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# how the activations are computed (``activation_elements``): fp32; bf16 under autocast (``train.bf16`` without
# FSDP: fp32 weights and residual stream, each linear's input cast); bf16 weights (FSDP2's param_dtype)
AUTOCAST = "autocast"
PRECISIONS = ("fp32", AUTOCAST, "bf16")
GIB = 1024**3
# rows alive during the forward/backward of a step, beside the model state
STEP_ROWS = ("activations", "logits", "compute_weights", "reduce_scatter")


@dataclass
class Estimate:
    """Per-rank counts and bytes of one layout (``bytes`` keys are the table rows)."""

    layout: dict
    params_full: int
    params_local: int
    trainable_local: int
    bytes: dict[str, int] = field(default_factory=dict)
    memory_gib: float | None = None
    runtime_bytes: int = 0  # resident memory of torch + transformers alone (not in the total)
    # under ``pp``: every stage's blocks, parameters, micro-batches in flight and peak (``pipeline_estimate``)
    stages: list[dict] = field(default_factory=list)
    # the vocabulary rows of each TP rank where tp does not divide it (torch's chunks, ``rows.chunk_rows``); the
    # counts above hold rank 0's, the largest
    vocab_rows: list[int] = field(default_factory=list)
    # under ``pp``: every rank's stages, what each holds at the rank's peak, and that peak
    ranks: list[dict] = field(default_factory=list)

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state: what a rank holds between steps."""
        return self.bytes["parameters"] + self.bytes["gradients"] + self.bytes["optimizer"]

    @property
    def offloaded(self) -> bool:
        return bool(self.layout.get("fsdp_offload"))

    @property
    def host_bytes(self) -> int:
        """Under ``fsdp_offload``: the model state and the optimizer's temporaries, in host memory."""
        return self.state_bytes + self.bytes["optimizer_temporaries"] if self.offloaded else 0

    @property
    def step_bytes(self) -> int:
        """The forward/backward phase: model state (on the device unless offloaded) plus everything a
        step allocates on top."""
        return (0 if self.offloaded else self.state_bytes) + sum(self.bytes[k] for k in STEP_ROWS)

    @property
    def optimizer_step_bytes(self) -> int:
        """The optimizer phase: model state plus the optimizer's temporaries (on the host when offloaded)."""
        return 0 if self.offloaded else self.state_bytes + self.bytes["optimizer_temporaries"]

    @property
    def fits(self) -> bool | None:
        return None if self.memory_gib is None else self.bytes["total"] <= self.memory_gib * GIB

    def to_dict(self) -> dict:
        phases = {"step_bytes": self.step_bytes, "optimizer_step_bytes": self.optimizer_step_bytes}
        phases["host_bytes"] = self.host_bytes
        return {**asdict(self), "state_bytes": self.state_bytes, **phases, "fits": self.fits}


def local_numel(shape: tuple[int, ...], tp_dim: int | None, tp: int, fsdp: int) -> int:
    """Elements of the largest local piece: TP chunk of ``tp_dim``, then FSDP's chunk of dim 0."""
    dims = list(shape)
    if tp_dim is not None:
        dims[tp_dim] = math.ceil(dims[tp_dim] / tp)
    if dims and fsdp > 1:
        dims[0] = math.ceil(dims[0] / fsdp)
    return math.prod(dims)


def _lora_shapes(module: nn.Module, r: int, style: str | None) -> list[tuple[tuple[int, int], int | None]]:
    """(shape, tp dim) of lora_A ``[r, in]`` and lora_B ``[out, r]`` for a targeted linear."""
    w = module.weight
    fan_in, fan_out = (w.shape[0], w.shape[1]) if is_conv1d(module) else (w.shape[1], w.shape[0])
    a_dim, b_dim = lora_dims(style) if style is not None else (None, None)
    return [((r, fan_in), a_dim), ((fan_out, r), b_dim)]


def count_params(
    model: nn.Module,
    styles: dict[str, str],
    tp: int,
    fsdp: int,
    lora_r: int | None = None,
    experts: dict | None = None,
    ep: int = 1,
) -> tuple[int, int, int, int]:
    """(full, local, trainable local, trainable tensors) parameter counts; tied parameters count once.
    ``experts``: the plan's per-parameter placements of ``experts`` modules (``Plan.experts``).
    ``ep`` > 1: the experts modules' parameters are divided over ep on dim 0, not chunked by FSDP."""
    experts = experts or {}
    ep_modules = set(experts_modules(model)) if ep > 1 else set()
    seen: set[int] = set()
    full = local = trainable = 0
    targeted = tensors = 0
    for mname, module in model.named_modules():
        style = styles.get(mname)
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            dim = sharded_dim(style, module, pname, experts.get(mname))
            if mname in ep_modules:  # Shard(0) over ep, TP inside each expert, left out by FSDP
                n = local_numel(local_shape(tuple(param.shape), 0, ep), dim, tp, 1)
            else:
                n = local_numel(tuple(param.shape), dim, tp, fsdp)
            full += param.numel()
            local += n
            trainable += 0 if lora_r else n
            tensors += 0 if lora_r else 1
        if lora_r and mname.rsplit(".", 1)[-1] in LORA_TARGETS and hasattr(module, "weight"):
            targeted += 1
            for shape, dim in _lora_shapes(module, lora_r, style):
                n = local_numel(shape, dim, tp, fsdp)
                full += math.prod(shape)
                local += n
                trainable += n
                tensors += 1
    if lora_r and not targeted:
        raise ConfigError(
            f"--lora-r: no linear layer of this model is named {'/'.join(LORA_TARGETS)}; LoRA has no target"
        )
    return full, local, trainable, tensors


def _dims(config) -> dict[str, int]:
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
    g = _dims(config)
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


def row_copies(model: nn.Module, plan: Plan) -> dict[str, int]:
    """Per parameter fqn, the elements a TP rank copies out of several row ranges of it where it is
    stored whole (``linear.take_rows``: a sliced projection of parts some held whole such as Mamba-2's
    ``in_proj`` at ``n_groups < tp``, the conv following it), saved for backward by the op using
    them: one copy per forward of their layer."""
    ranks_rows = [(fqn, "weight", rows) for fqn, rows in plan.sliced.items()]  # per rank: its row ranges
    ranks_rows += [(fqn, p, param_rows(plan, fqn, p)) for fqn, names in plan.channels.items() for p in names]
    copies = {}
    for fqn, pname, rows in ranks_rows:
        module = model.get_submodule(fqn)
        # a bias is only added, its copy not kept; a buffer's rows (Falcon-H1's ``mup_vector``) are
        # counted with its mixer (``scans.py``), as one process keeps the buffer itself
        params = dict(module.named_parameters(recurse=False))
        if rows is not None and len(rows[0]) > 1 and pname != "bias" and pname in params:
            p = params[pname]
            copies[f"{fqn}.{pname}"] = sum(b - a for a, b in rows[0]) * (p.numel() // p.shape[lead_dim(p)])
    return copies


def local_channels(plan: Plan, conv: str, channels: int, tp: int) -> int:
    """The channels of ``per_channel`` convolution ``conv`` rank 0 computes: its rows where it is
    stored whole (Mamba-2's, whose B and C parts stay whole at ``n_groups < tp``), else ``1/tp``."""
    rows = param_rows(plan, conv, "weight")
    if rows is None:
        return channels // tp
    return sum(b - a for a, b in rows[0])


def tp_local_elements(
    model: nn.Module, styles: dict[str, str], tp: int, prefix: str = "", experts: dict | None = None, skip=()
) -> int:
    """Elements ``model`` (or a submodule whose fqn is ``prefix``) holds per TP rank, before FSDP;
    ``skip``: module fqns left out (the experts under EP, which FSDP does not gather)."""
    experts = experts or {}
    seen: set[int] = set()
    n = 0
    for mname, sub in model.named_modules():
        fqn = ".".join(x for x in (prefix, mname) if x)
        for pname, p in sub.named_parameters(recurse=False):
            if id(p) not in seen and fqn not in skip:
                seen.add(id(p))
                n += local_numel(tuple(p.shape), sharded_dim(styles.get(fqn), sub, pname, experts.get(fqn)), tp, 1)
    return n


def _block_elements(
    model: nn.Module, styles: dict[str, str], tp: int, experts: dict | None = None, skip=()
) -> tuple[int, int]:
    """(TP-local elements of one decoder block, number of blocks); the whole model when it has none."""
    blocks = decoder_blocks(model)
    if not blocks:
        return tp_local_elements(model, styles, tp, experts=experts, skip=skip), 1
    names = {id(m): n for n, m in model.named_modules()}
    return tp_local_elements(blocks[0], styles, tp, names[id(blocks[0])], experts, skip), len(blocks)


def _gathered_elements(model: nn.Module, styles: dict[str, str], tp: int, experts: dict | None = None, skip=()) -> int:
    """TP-local elements FSDP all-gathers at once: the root's parameters plus two decoder blocks (prefetch)."""
    block, count = _block_elements(model, styles, tp, experts, skip)
    return tp_local_elements(model, styles, tp, experts=experts, skip=skip) - count * block + min(2, count) * block


def _compute_weight_bytes(
    model: nn.Module, styles: dict[str, str], tp: int, fsdp: int, bf16: bool, experts: dict | None = None, skip=()
) -> int:
    """Weights in the compute dtype held beside the master shards (see the module docstring)."""
    if fsdp > 1:
        return (2 if bf16 else 4) * _gathered_elements(model, styles, tp, experts, skip)
    return 2 * tp_local_elements(model, styles, tp, experts=experts) if bf16 else 0


def _ep_casts(model: nn.Module, styles: dict[str, str], plan: Plan, skip: set[str], tp: int, ep: int) -> int:
    """EP under bf16: each layer's local experts cast to bf16 in its forward, kept for its backward."""
    return (
        sum(
            count_params(model.get_submodule(fqn), {"": styles.get(fqn)}, tp, 1, None, {"": plan.experts.get(fqn)})[1]
            for fqn in skip
        )
        // ep
    )


def _check_sequence_parallel(model: nn.Module, plan: Plan, tp: int, seq: int, cp: int) -> None:
    """``--sequence-parallel`` as ``parallel.sequence_parallel`` is checked (``config/load.py``, preflight):
    it slices a rank's ``seq / cp`` tokens over tp."""
    if tp == 1 or (seq // cp) % tp:
        held = f"--seq {seq}" if cp == 1 else f"--seq / --cp = {seq // cp}"
        raise ConfigError(f"--sequence-parallel splits the sequence over --tp: needs --tp > 1 dividing {held}")
    why = sequence_refusal(model, plan)
    if why is not None:
        raise ConfigError(f"--sequence-parallel cannot run this model: {why}")


def _check_layout(
    tp: int,
    fsdp: int,
    dp_replicate: int,
    batch: int,
    seq: int,
    ep: int,
    lora_r: int | None,
    memory_gib: float | None,
    cp: int = 1,
) -> None:
    """The layout ``estimate`` is asked about, checked before the model is read (one ``ConfigError``
    line): each flag against the range of the config key it stands for (``config/ranges.py``)."""
    for flag, key, value in (
        ("--tp", "parallel.tp", tp),
        ("--fsdp", "parallel.fsdp", fsdp),
        ("--dp-replicate", "parallel.dp_replicate", dp_replicate),
        ("--batch", "train.per_device_train_batch_size", batch),
        ("--seq", "data.seq_len", seq),
        ("--ep", "parallel.ep", ep),
        ("--cp", "parallel.cp", cp),
    ):
        check_value(key, value, flag)
    check_world(tp * cp, fsdp, dp_replicate, "--dp-replicate x --fsdp x --cp x --tp")
    if seq % (2 * cp):
        raise ConfigError(f"--seq {seq} must be a multiple of 2 x --cp = {2 * cp}: each window is cut in 2*cp chunks")
    if not ParallelConfig(tp, fsdp, dp_replicate, ep, cp=cp).ep_fits:
        raise ConfigError(
            f"--ep {ep} must divide --fsdp x --cp = {fsdp * cp} or be a multiple of it dividing --dp-replicate x "
            "--fsdp x --cp: expert-parallel ranks are carved out of the data- and context-parallel ranks"
        )
    if lora_r is not None and lora_r < 1:
        raise ConfigError(f"--lora-r must be >= 1, got {lora_r}")
    if memory_gib is not None and memory_gib <= 0:
        raise ConfigError(f"--memory must be a positive number of GiB, got {memory_gib}")


def _check_cp_attention(model: nn.Module, cp: int, cp_attention: str, tp: int) -> None:
    """``--cp-attention`` as ``parallel.cp_attention`` would take it (``parallel/runtime/ulysses.py``)."""
    if cp_attention not in ParallelConfig.CP_ATTENTIONS:
        raise ConfigError(
            f"--cp-attention must be one of {', '.join(ParallelConfig.CP_ATTENTIONS)}, got '{cp_attention}'"
        )
    geometry = read_geometry(model.config.get_text_config())
    why = ulysses_refusal(geometry.heads or 0, geometry.kv or 0, tp, cp) if cp_attention == ULYSSES else None
    if why is not None:
        raise ConfigError(f"--cp-attention {ULYSSES} at --cp {cp}: {why}; use --cp-attention all_gather")


def _check_offload(fsdp_offload: bool, dp_size: int, ep: int) -> None:
    """``--fsdp-offload`` where ``parallel.fsdp_offload=cpu`` would be refused (``config/load.py``)."""
    if fsdp_offload and dp_size == 1:
        raise ConfigError("--fsdp-offload offloads FSDP's shards: it needs --fsdp or --dp-replicate > 1")
    if fsdp_offload and ep > 1:
        raise ConfigError("--fsdp-offload with --ep > 1 is not supported: the experts are outside FSDP")


def _mixers(
    model: nn.Module, plan: Plan, styles: dict[str, str], batch: int, seq: int, tp: int, act_bytes: int
) -> list[int]:
    """The activation elements of each recurrent mixer; its heads are split where the plan splits its
    convolution's channels (``per_channel``)."""
    return [
        mixer_elements(m, batch, seq, tp, 4 // act_bytes, local_channels(plan, m.conv, m.channels, tp))
        if styles.get(m.conv) == Style.PER_CHANNEL
        else mixer_elements(m, batch, seq, 1, 4 // act_bytes)
        for m in mixer_sizes(model)
    ]


def estimate(
    model_path: str,
    tp: int = 1,
    fsdp: int = 1,
    dp_replicate: int = 1,
    batch: int = 4,
    seq: int | None = None,
    bf16: bool = False,
    lora_r: int | None = None,
    gradient_checkpointing: bool = False,
    memory_gib: float | None = None,
    ep: int = 1,
    sequence_parallel: bool = False,
    fsdp_offload: bool = False,
    cp: int = 1,
    pp: int = 1,
    pp_schedule: str = "1F1B",
    pp_microbatches: int | None = None,
    cp_attention: str = "all_gather",
    pp_virtual_stages: int | None = None,
) -> Estimate:
    """Per-rank memory of training ``model_path`` with this layout (``batch`` sequences per rank of
    ``seq`` tokens, default 128 or the model's positions if fewer; ``ep``: expert parallelism,
    carved out of the data-parallel ranks; ``sequence_parallel``: ``parallel.sequence_parallel``;
    ``fsdp_offload``: the model state in host memory; ``cp``: context parallelism, each sequence
    split between ``cp`` ranks, FSDP sharding over ``fsdp x cp``; ``cp_attention``: its variant,
    ``parallel.cp_attention``; ``pp``: pipeline stages run by ``pp_schedule`` over ``pp_microbatches``
    (default ``pp``) micro-batches of ``batch`` sequences, ``pp_virtual_stages`` stages a rank (default: as
    ``parallel.pp_virtual_stages``), see ``pipeline_estimate``)."""
    check_model_dir(model_path)
    _check_offload(fsdp_offload, fsdp * dp_replicate, ep)
    if seq is None:
        bound = max_positions(model_config(model_path))
        seq = min(DEFAULT_SEQ, bound[1]) if bound else DEFAULT_SEQ
    _check_layout(tp, fsdp, dp_replicate, batch, seq, ep, lora_r, memory_gib, cp)
    check_value("parallel.pp", pp, "--pp")
    layout = {"tp": tp, "fsdp": fsdp, "cp": cp, "ep": ep, "dp_replicate": dp_replicate, "batch": batch, "seq": seq}
    layout |= {"bf16": bf16, "lora_r": lora_r, "gradient_checkpointing": gradient_checkpointing}
    layout |= {"sequence_parallel": sequence_parallel, "fsdp_offload": fsdp_offload, "cp_attention": cp_attention}
    if pp > 1:
        schedule = schedule_name(pp_schedule)
        check_microbatches(pp, schedule, pp_microbatches or pp)
        per_rank = stages_per_rank(schedule, pp_virtual_stages)
        layout |= {"pp": pp, "pp_schedule": schedule, "pp_microbatches": pp_microbatches or pp}
        layout |= {"pp_virtual_stages": per_rank}
    baseline = resident_bytes()  # before the meta model and the plan's trace add their own
    check_geometry(model_path, tp)
    check_seq_len(model_config(model_path), seq, "--seq")
    model = build_meta_model(model_path)
    check_ep(model, ep)
    _check_cp_attention(model, cp, cp_attention, tp)
    plan = infer_plan(model, tp)
    if sequence_parallel:
        _check_sequence_parallel(model, plan, tp, seq, cp)
    if pp > 1:
        est = pipeline_estimate(model, plan, layout, memory_gib, baseline)
    else:
        est = model_estimate(model, model.config, plan, layout, memory_gib, baseline)
    vocab = read_geometry(model.config).vocab
    est.vocab_rows = chunk_rows(vocab, tp) if vocab and vocab % tp else []
    return est


def model_estimate(
    model: nn.Module,
    config,
    plan: Plan,
    layout: dict,
    memory_gib: float | None,
    baseline: int,
    held: int = 1,
    last: bool = True,
) -> Estimate:
    """The rows of ``model`` (the whole model, or one pipeline stage cut by ``estimate/stages.py`` with
    ``config`` its own and ``plan`` narrowed to it) at ``layout`` (``estimate``'s keys); ``held``:
    the micro-batches whose activations it holds at once; ``last``: it computes the final norm and logits."""
    tp, fsdp, ep, cp, batch, seq = (layout[k] for k in ("tp", "fsdp", "ep", "cp", "batch", "seq"))
    bf16, lora_r, checkpointing = layout["bf16"], layout["lora_r"], layout["gradient_checkpointing"]
    skip = set(experts_modules(model)) if ep > 1 else set()  # EP: the experts are not FSDP's
    # sliced projections (kv heads replicated, parts held whole) are stored whole on every TP rank
    styles = {fqn: "replicate" if fqn in plan.sliced else style for fqn, style in plan.styles.items()}
    shards = fsdp * cp  # FSDP2 shards over fsdp x cp (``distributed/mesh.py``)
    full, local, trainable, tensors = count_params(model, styles, tp, shards, lora_r, plan.experts, ep)
    ep_casts = _ep_casts(model, styles, plan, skip, tp, ep) if bf16 else 0
    act_bytes = 2 if bf16 else 4
    tokens = batch * seq // cp  # this rank's
    copies = row_copies(model, plan).values()
    mixers = _mixers(model, plan, styles, batch, seq, tp, act_bytes)
    cp_attention = layout.get("cp_attention", "all_gather")
    stack = activation_elements(
        config, tokens, tp, checkpointing, lora_r, moe_sizes(model), mixers, layout["sequence_parallel"], cp,
        held, last, cp_attention, layout["sequence_parallel"] and stream_ends(model, plan) is not None,
        _precision(bf16, shards * layout["dp_replicate"] > 1),
    )  # fmt: skip
    rows = {
        # a LoRA run under bf16 stores its frozen base in bf16 (``parallel/runtime/lora.py``); what trains stays fp32
        "parameters": 4 * local if not (lora_r and bf16) else 2 * local + 2 * trainable,
        "gradients": 4 * trainable,
        "optimizer": 8 * trainable + 4 * tensors,  # exp_avg, exp_avg_sq, and AdamW's fp32 ``step`` per tensor
        "activations": act_bytes
        * (
            stack
            + held * context_mask_elements(config, batch, seq, cp, cp_attention)
            # with gradient checkpointing one layer's at a time: the largest
            + (max(copies, default=0) if checkpointing else held * sum(copies))
        ),
        # the log-softmax of every micro-batch in flight, and one gradient
        "logits": (held + 1) * 4 * tokens * math.ceil(_dims(config)["V"] / tp) if last else 0,
        "compute_weights": _compute_weight_bytes(model, styles, tp, shards, bf16, plan.experts, skip) + 2 * ep_casts,
        "reduce_scatter": (
            4 * _block_elements(model, styles, tp, plan.experts, skip)[0]
            if shards * layout["dp_replicate"] > 1 and not lora_r
            else 0
        ),
        "optimizer_temporaries": 4 * trainable,  # foreach AdamW: sqrt(exp_avg_sq), one fp32 copy
    }
    est = Estimate(dict(layout), full, local, trainable, rows, memory_gib, baseline)
    rows["total"] = max(est.step_bytes, est.optimizer_step_bytes)  # the device's peak (host_bytes apart)
    return est


def _precision(bf16: bool, fsdp_on: bool) -> str:
    """``PRECISIONS``' word for a run: bf16 weights where FSDP2 casts them (``trainer.mixed_precision_policy``),
    else autocast (``train.bf16`` without FSDP; a LoRA run's bf16 frozen base aside, its adapters are fp32)."""
    if not bf16:
        return "fp32"
    return "bf16" if fsdp_on else AUTOCAST


def pipeline_estimate(model: nn.Module, plan: Plan, layout: dict, memory_gib: float | None, baseline: int) -> Estimate:
    """Under ``pp``: each stage as the ranks cut it (``estimate/stages.py``), its activations those of the
    micro-batches the schedule keeps in flight there, and each rank its stages together at the moment of
    its schedule when their activations are largest (``held_states``). The estimate of the rank with the
    highest peak, with ``params_full`` the whole model's, ``stages`` (every stage's rank, blocks, parameters,
    most micro-batches in flight and peak), ``ranks`` (every rank's stages, what each holds at its peak, and
    that peak) and the schedule's bubble in ``layout``."""
    pp, schedule, chunks, per_rank = (layout[k] for k in ("pp", "pp_schedule", "pp_microbatches", "pp_virtual_stages"))
    total = pp * per_rank
    _, stages = cut_stages(model, plan, total)
    cache: dict[tuple[int, int], Estimate] = {}

    def held(stage: int, count: int) -> Estimate:  # stage ``stage`` holding ``count`` micro-batches (at least 1)
        if (stage, max(count, 1)) not in cache:
            part = stages[stage]
            config = part.model.base_model.config  # its own: its blocks' count and kinds (``keep_stage``)
            cache[stage, max(count, 1)] = model_estimate(
                part.model, config, part.plan, layout, memory_gib, baseline, max(count, 1), part.last(total)
            )
        return cache[stage, max(count, 1)]

    ranks = [_rank_peak(rank, states, held, layout, memory_gib, baseline) for rank, states in enumerate(
        held_states(schedule, pp, per_rank, chunks))]  # fmt: skip
    most = {s: max(state.get(s, 0) for r in ranks for state in r["states"]) for s in range(total)}
    peak = max(ranks, key=lambda r: r["estimate"].bytes["total"])["estimate"]
    peak.layout["bubble"] = bubble(pp, chunks, schedule, per_rank)
    owner = {s: r["rank"] for r in ranks for s in r["held"]}
    peak.stages = [_stage_row(stage, owner[stage.index], most[stage.index], held(stage.index, most[stage.index]))
                   for stage in stages]  # fmt: skip
    peak.ranks = [{k: v for k, v in r.items() if k not in ("estimate", "states")} for r in ranks]
    peak.params_full = sum(held(s, 1).params_full for s in range(total))  # the stages hold disjoint parameters
    return peak


def _stage_row(stage, rank: int, count: int, est: Estimate) -> dict:
    return {
        "stage": stage.index,
        "rank": rank,
        "blocks": [stage.blocks.start, stage.blocks.stop],
        "params": est.params_full,
        "params_local": est.params_local,
        "in_flight": count,
        "activations": est.bytes["activations"],
        "total": est.bytes["total"],
        "state": est.state_bytes,  # parameters, gradients, optimizer state: on the host under fsdp_offload
        "host": est.host_bytes,
    }


_HELD_ROWS = ("activations", "logits")  # a stage's rows that scale with the micro-batches it holds


def _rank_peak(rank: int, states: list[dict[int, int]], held, layout: dict, memory_gib, baseline) -> dict:
    """Rank ``rank``'s estimate: its stages' model state and buffers summed, and the activations and logits
    its stages hold together at the step of its schedule where those are largest (``states``: what each
    stage holds after each action; ``held(stage, count)``: a stage's estimate holding ``count``)."""

    def live(state: dict[int, int]) -> int:
        return sum(held(s, n).bytes[k] for s, n in state.items() if n for k in _HELD_ROWS)

    top = max(states, key=live)
    parts = [held(s, 1) for s in top]
    rows = {k: sum(p.bytes[k] for p in parts) for k in parts[0].bytes if k not in (*_HELD_ROWS, "total")}
    rows |= {k: sum(held(s, n).bytes[k] for s, n in top.items() if n) for k in _HELD_ROWS}
    est = Estimate(dict(layout), sum(p.params_full for p in parts), sum(p.params_local for p in parts),
                   sum(p.trainable_local for p in parts), rows, memory_gib, baseline)  # fmt: skip
    rows["total"] = max(est.step_bytes, est.optimizer_step_bytes)
    return {"rank": rank, "held": dict(top), "activations": rows["activations"], "logits": rows["logits"],
            "total": rows["total"], "estimate": est, "states": states}  # fmt: skip


def _human(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def stage_lines(est: Estimate) -> list[str]:
    """Under ``pp``: a line per stage (its rank, blocks, parameters, most micro-batches in flight, activations
    and peak), the schedule's bubble, and which rank the rows below are."""
    lay = est.layout
    per_rank = lay.get("pp_virtual_stages", 1)
    formula = "(p-1)/(m+p-1)" if per_rank == 1 else "(p-1)/(v m+p-1)"
    if lay["pp_schedule"] in PP_SPLIT_BACKWARD:
        formula = "about 0 (the weight passes fill it)"
    lines = [
        f"{lay['pp_schedule']} over {lay['pp_microbatches']} micro-batches of {lay['batch']} sequences: bubble "
        f"{formula} = {lay['bubble']:.3f} of each step",
        f"{'stage':<5}  {'rank':<4}  {'blocks':<9}  {'parameters':>12}  {'in flight':>9}  {'activations':>12}  "
        f"{'peak':>12}",
    ]
    for st in est.stages:
        start, stop = st["blocks"]
        lines.append(
            f"{st['stage']:<5}  {st['rank']:<4}  {f'{start}-{stop - 1}':<9}  {st['params']:>12,}  "
            f"{st['in_flight']:>9}  {_human(st['activations']):>12}  {_human(st['total']):>12}"
        )
    peak = max(est.ranks, key=lambda r: r["total"])
    held = ", ".join(f"stage {s}: {n}" for s, n in peak["held"].items())
    lines.append(f"the rows below: rank {peak['rank']}, the highest peak (micro-batches held then: {held})")
    return lines


def format_table(est: Estimate) -> str:
    """The readable report ``shardlm estimate`` prints."""
    lay = est.layout
    lines = [
        (
            f"layout tp={lay['tp']} fsdp={lay['fsdp']} dp_replicate={lay['dp_replicate']}"
            f"{' ep=' + str(lay['ep']) if lay.get('ep', 1) > 1 else ''}"
            f"{' cp=' + str(lay['cp']) if lay.get('cp', 1) > 1 else ''}"
            f"{' (ulysses)' if lay.get('cp', 1) > 1 and lay.get('cp_attention') == ULYSSES else ''}"
            f"{' pp=' + str(lay['pp']) if lay.get('pp', 1) > 1 else ''}, per rank: "
            f"batch {lay['batch']} x seq {lay['seq']}{', bf16' if lay['bf16'] else ', fp32'}"
            f"{', LoRA r=' + str(lay['lora_r']) if lay['lora_r'] else ''}"
            f"{', gradient checkpointing' if lay['gradient_checkpointing'] else ''}"
            f"{', sequence parallel' if lay.get('sequence_parallel') else ''}"
            f"{', FSDP CPU offload' if lay.get('fsdp_offload') else ''}"
        ),
        (
            f"parameters: {est.params_full:,} in the model, {est.params_local:,} on each rank"
            f"{' of the stage with the highest peak' if est.stages else ''}, {est.trainable_local:,} trainable"
        ),
    ]
    if est.vocab_rows:
        rows = " | ".join(map(str, est.vocab_rows))
        lines.append(
            f"vocabulary: {sum(est.vocab_rows):,} rows in torch's chunks, {rows} per TP rank "
            "(the embedding and LM head counted at rank 0's, the largest)"
        )
    if est.stages:
        lines += stage_lines(est)
    for key, value in est.bytes.items():
        if key == "total":
            lines.append(f"{'':-<21}  {'':->12}")
            lines.append(f"{'step phase':<21}  {_human(est.step_bytes):>12}")
            lines.append(f"{'optimizer phase':<21}  {_human(est.optimizer_step_bytes):>12}")
            key = "total (peak)"
        lines.append(f"{key:<21}  {_human(value):>12}")
    if est.offloaded:
        note = "(fsdp_offload: parameters, gradients, optimizer state; not in the total)"
        lines.append(f"{'+ host memory':<21}  {_human(est.host_bytes):>12}  {note}")
    if est.runtime_bytes:
        note = "(torch + transformers, measured here; not in the total)"
        lines.append(f"{'+ runtime':<21}  {_human(est.runtime_bytes):>12}  {note}")
    if est.memory_gib is not None:
        verdict = "fits" if est.fits else "does NOT fit"
        lines.append(
            f"{verdict} in {est.memory_gib:g} GiB per rank ({_human(abs(est.memory_gib * GIB - est.bytes['total']))} "
            f"{'to spare' if est.fits else 'short'})"
        )
    return "\n".join(lines)
