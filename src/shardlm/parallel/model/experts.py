"""Mixture-of-experts modules as the model holds them: fused 3-D experts (``is_experts_module``),
where they sit (``experts_modules``, inside the decoder blocks), the attributes holding their count
(``count_attrs``) and how their forward is called (``experts_call``). Read off the model only; the
plan's placement of their parameters is ``infer/experts.py``'s, their sizes for the estimate
``estimate/moe.py``'s.
"""

from __future__ import annotations

import inspect

import torch.nn as nn


def block_prefixes(model: nn.Module) -> tuple[str, ...]:
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, nn.ModuleList))


def is_experts_module(module: nn.Module) -> bool:
    """Own parameters all of one leading size E, at least two of them 3-D (fused experts); E > 1, or
    1 in a module whose class names it experts (Hunyuan-MoE's default config has a single expert); and no
    submodule holding parameters: fused experts are their parameters alone, while Zamba's Mamba mixer, whose
    per-head ``x_proj_weight``/``dt_proj_weight`` are 3-D of one leading size too, wraps linears and a conv."""
    own = [p for p in module.parameters(recurse=False)]
    three_d = [p for p in own if p.dim() == 3]
    if len(three_d) < 2 or len({p.shape[0] for p in own}) != 1:
        return False
    if any(True for m in module.children() for _ in m.parameters()):
        return False
    return own[0].shape[0] > 1 or "Experts" in type(module).__name__


def is_experts_like(module: nn.Module) -> bool:
    """A module owning one 3-D parameter of leading size > 1 (JetMoE's per-expert linear)."""
    own = list(module.parameters(recurse=False))
    return len(own) == 1 and own[0].dim() == 3 and own[0].shape[0] > 1


def experts_modules(model: nn.Module) -> list[str]:
    """FQNs of the fused experts modules inside the decoder blocks (``is_experts_module``)."""
    blocks = block_prefixes(model)
    return [name for name, m in model.named_modules() if name.startswith(blocks) and is_experts_module(m)]


def count_attrs(module: nn.Module) -> list[str]:
    """Integer attributes of an experts module holding its expert count (``num_experts``), found by
    value and name: what a forward on fewer experts (a probe, an expert-parallel rank) must change."""
    count = next(module.parameters()).shape[0]
    return [
        name
        for name, value in vars(module).items()
        if "expert" in name and isinstance(value, int) and not isinstance(value, bool) and value == count
    ]


KERNEL, FOLDED, EVERY_TOKEN = "kernel", "folded", "every_token"


def experts_call(module: nn.Module) -> str:
    """How an experts module's forward is called, by its positional arguments: ``KERNEL``, transformers'
    kernels' ``(hidden_states, top_k_index, top_k_weights)``; ``FOLDED``, the hidden states alone with
    the routing folded in (Llama 4's ``Llama4TextExperts``: every expert's rows stacked ``[E * tokens, H]``,
    each already scaled by the router's score for it, zero where the expert was not chosen);
    ``EVERY_TOKEN``, ``(hidden_states, weights [tokens, E])``: every expert on every token, scaled
    (Inkling's shared experts and their gammas)."""
    params = inspect.signature(module.forward).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {1: FOLDED, 2: EVERY_TOKEN}.get(len(positional), KERNEL)
