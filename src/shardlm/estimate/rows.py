"""The rows of one model or pipeline stage at a layout (``model_estimate``), and the ``Estimate`` holding them.

The peak is the larger of two phases: the step (the model state plus the rows of ``STEP_ROWS``: the
activations, logits, compute copies of the weights and FSDP's unsharded gradients of a block, alive
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

import math
from dataclasses import asdict, dataclass, field

from torch import nn

from shardlm.estimate.activations import AUTOCAST, activation_elements, context_mask_elements, text_dims
from shardlm.estimate.mixers import mixer_elements, mixer_sizes
from shardlm.estimate.moe import moe_sizes
from shardlm.estimate.params import block_elements, compute_weight_bytes, count_params, local_channels, row_copies
from shardlm.parallel.model.experts import experts_modules
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.sequence import stream_ends
from shardlm.parallel.plan.styles import Style

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


def _ep_casts(model: nn.Module, styles: dict[str, str], plan: Plan, skip: set[str], tp: int, ep: int) -> int:
    """EP under bf16: each layer's local experts cast to bf16 in its forward, kept for its backward."""
    return (
        sum(
            count_params(model.get_submodule(fqn), {"": styles.get(fqn)}, tp, 1, None, {"": plan.experts.get(fqn)})[1]
            for fqn in skip
        )
        // ep
    )


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
        "logits": (held + 1) * 4 * tokens * math.ceil(text_dims(config)["V"] / tp) if last else 0,
        "compute_weights": compute_weight_bytes(model, styles, tp, shards, bf16, plan.experts, skip) + 2 * ep_casts,
        "reduce_scatter": (
            4 * block_elements(model, styles, tp, plan.experts, skip)[0]
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
