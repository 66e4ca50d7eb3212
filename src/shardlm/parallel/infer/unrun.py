"""Modules whose forward never runs in the traced text forward (``Plan.unrun``): a decoder-only class's
cross-attention (BART's, Whisper's ``encoder_attn``: no encoder states on text rows), a multimodal checkpoint's
vision or audio tower. No trace placed them, so they are stored whole on every rank (``plan/kept_whole.py``),
except a cross-attention of the class of a split attention with the same parameters (``split_like``): it is
split by heads as that one is, so each rank stores its heads only.
"""

from __future__ import annotations

import torch.nn as nn

from shardlm.parallel.infer.trace_result import Traced
from shardlm.parallel.plan.plan import Plan


def unrun(meta: nn.Module, traced: Traced) -> list[str]:
    """The outermost modules holding parameters none of whose forwards ran in the trace, nor had their
    parameters read by another module's forward (``Traced.foreign``, ``direct``, ``row_reads``)."""
    used = {o.split(" (")[0] for o in [*traced.foreign, *traced.row_reads.values()]} | traced.direct
    found: list[str] = []
    for name, module in meta.named_modules():
        if not name or any(name.startswith(f"{f}.") for f in found) or not any(True for _ in module.parameters()):
            continue
        below = [n for n, _ in module.named_modules(prefix=name)]
        if not any(n in traced.ran or n in used for n in below):
            found.append(name)
    return found


def split_like(model: nn.Module, plan: Plan) -> None:
    """Each never-run module (``Plan.unrun``) of the class of a split attention (``Plan.attention``) holding
    the same parameters by name and shape gets that attention's styles: a module's forward splits by heads
    what its own linears compute, whatever the inputs (an encoder's states for BART's cross-attention), and its
    head counts are localized like the traced one's (``local_geometry``). Only a plain split is copied: none of
    the traced one's linears sliced (kv heads fewer than tp), packed or followed by per-channel parameters,
    nor sizes or per-head inputs of its own; else it stays whole."""
    for fqn in plan.unrun:
        module = model.get_submodule(fqn)
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        for traced in plan.attention:
            other = model.get_submodule(traced)
            if type(other) is not type(module) or shapes != {n: tuple(p.shape) for n, p in other.named_parameters()}:
                continue
            styles = {n: plan.styles.get(f"{traced}.{n}" if n else traced) for n, _ in other.named_modules()}
            plain = all(s in (None, "colwise", "rowwise", "replicate") for s in styles.values())
            tables = (plan.sliced, plan.stored_rows, plan.channels, plan.local_sizes, plan.head_inputs, plan.replicated)
            own = [f for table in tables for f in table]
            if plain and not any(f == traced or f.startswith(f"{traced}.") for f in own):
                for n, style in styles.items():
                    if style is not None:
                        plan.styles[f"{fqn}.{n}" if n else fqn] = style
                plan.attention = sorted({*plan.attention, fqn})
                break
