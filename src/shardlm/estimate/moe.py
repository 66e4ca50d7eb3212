"""The estimate's mixture-of-experts sizes: each experts layer's widths read off its parameters
(``MoeSizes``) and the activations its forward saves (``moe_elements``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from shardlm.parallel.model.experts import experts_modules
from shardlm.parallel.model.hf import config_size, config_value


@dataclass(frozen=True)
class MoeSizes:
    """One mixture-of-experts layer's sizes for ``shardlm estimate``, read from its parameters:
    ``experts`` E, ``in_width`` the in-projection's output per expert (``2I`` gate and up, or ``I``),
    ``width`` I (the down projection's input), ``shared``: the summed widths of dense MLPs beside
    the experts in the block (Qwen2-MoE's shared expert), 0 without; ``gates``: 1-wide linear
    layers beside them (Qwen2-MoE's sigmoid gate on the shared expert's output)."""

    experts: int
    in_width: int
    width: int
    shared: int
    gates: int = 0


def moe_sizes(model: nn.Module) -> list[MoeSizes]:
    """``MoeSizes`` of each experts module of ``model`` (``experts_modules``): each 3-D parameter's
    dim other than the hidden width is its projection's width (the smaller one the down projection's
    input); a linear layer beside the experts in their block that maps to the hidden width is the
    down projection of a dense MLP of its input width."""
    hidden = config_size(model.config, "hidden_size")
    out = []
    for fqn in experts_modules(model):
        module = model.get_submodule(fqn)
        widths = sorted(
            next((d for d in p.shape[1:] if d != hidden), hidden)
            for p in module.parameters(recurse=False)
            if p.dim() == 3
        )
        block = model.get_submodule(fqn.rpartition(".")[0])
        inside = set(module.modules())
        beside = {  # per module holding linear layers beside the experts: their (in, out) widths
            m: [(c.in_features, c.out_features) for c in m.children() if isinstance(c, nn.Linear)]
            for m in block.modules()
            if m not in inside
        }
        # a dense MLP's width: its down projection's input (one per module: gate/up map h -> h when I = h)
        shared = sum(max((i for i, o in lin if o == hidden), default=0) for lin in beside.values())
        gates = sum(o == 1 for lin in beside.values() for _, o in lin)
        out.append(MoeSizes(next(module.parameters()).shape[0], widths[-1], widths[0], shared, gates))
    return out


def moe_elements(config, sizes: MoeSizes, tokens: int, tp: int) -> int:
    """Elements one mixture-of-experts layer saves for backward in place of a dense MLP's ``4f/t``
    per token (see the module docstring), transformers' grouped-matmul experts kernel (its default)."""
    top_k = config_value(config, "num_experts_per_tok") or 1
    h, t = config_size(config, "hidden_size"), tp
    gated = sizes.width if sizes.in_width == 2 * sizes.width else 0  # act(gate) * up: one more I
    pair = (sizes.in_width + sizes.width + gated) // t + 2 * h + 10
    return tokens * (sizes.experts + 1 + top_k * pair + 4 * sizes.shared // t + sizes.gates * (h + 2))
