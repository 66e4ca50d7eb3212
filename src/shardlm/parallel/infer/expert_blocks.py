"""Experts stacked in a submodule rather than fused in the experts module itself: DBRX's
``DbrxExperts`` (transformers' kernel signature ``(hidden_states, top_k_index, top_k_weights)``)
holds no parameter of its own; its ``mlp`` (``DbrxExpertGLU``) holds ``w1``, ``v1``, ``w2``, each
``[E * I, H]``: every expert's ``[I, H]`` matrix stacked along dim 0, which the forward views back
as ``[E, I, H]`` by the module's ``ffn_hidden_size``.

Split as DeepSpeed and Megatron split a list of expert MLPs: each expert's MLP as a dense one,
along its intermediate dim: each of the E stacked matrices split on its own (dim 0 in E parts, so
rank r holds rows ``[r I/tp, (r+1) I/tp)`` of every expert), the int attributes equal to I the forward
views by set to I/tp on every rank (``Plan.local_sizes``). The experts module takes the ``experts``
style (the routing weights and hidden states it is handed summed over TP in backward, its partial
output all-reduced once), the submodule ``per_channel`` (its local pieces, no collective of its own).

Derived by a probe, not by names: a CPU copy of the experts module cut to a few experts (every
parameter's stacked rows and every expert-count attribute), random fp64 values, run whole on random
hidden states, expert indices and routing weights, then once per TP rank on its pieces with the
width attributes localized; the split is the plan only if the rank outputs sum to the whole output.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from shardlm.parallel.infer.expert_split import PROBE_RTOL, local_positions, probe_inputs
from shardlm.parallel.model.experts import KERNEL
from shardlm.parallel.plan.styles import ExpertParam

_PROBE_EXPERTS = 4


def stacked_count(module: nn.Module) -> int | None:
    """E where ``module`` owns no parameter, holds at least two in submodules, and every one of them
    stacks E experts along dim 0 (``[E * I, ...]``, I > 1); E is an int attribute of ``module``
    naming experts (``num_experts``). None otherwise."""
    params = list(module.named_parameters())
    if any(True for _ in module.parameters(recurse=False)) or len(params) < 2:
        return None
    counts = [v for a, v in vars(module).items() if "expert" in a and isinstance(v, int) and not isinstance(v, bool)]
    for count in counts:
        if count > 1 and all(p.dim() >= 2 and p.shape[0] % count == 0 and p.shape[0] > count for _, p in params):
            return count
    return None


def width_attrs(module: nn.Module, width: int) -> dict[str, list[str]]:
    """Int attributes equal to an expert's intermediate ``width``, by submodule path (relative to
    ``module``, "" itself): the sizes its forward views the stacked experts by."""
    found: dict[str, list[str]] = {}
    for path, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, int) and not isinstance(value, bool) and value == width:
                found.setdefault(path, []).append(attr)
    return found


def _cut(module: nn.Module, count: int, keep: int, g: torch.Generator) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A CPU copy of ``module`` (on meta) cut to ``keep`` experts: random fp64 values of its first
    experts' stacked rows, its expert-count attributes set to ``keep``."""
    probe = copy.deepcopy(module)
    values = {}
    for name, p in module.named_parameters():
        rows = p.shape[0] // count * keep
        values[name] = torch.randn((rows, *p.shape[1:]), generator=g, dtype=torch.float64) / p.shape[-1] ** 0.5
    for sub in probe.modules():
        sub._parameters = {n: None for n in sub._parameters}
        sub._buffers = {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in sub._buffers.items() if b is not None}
        for attr, value in list(vars(sub).items()):
            if "expert" in attr and isinstance(value, int) and not isinstance(value, bool) and value == count:
                setattr(sub, attr, keep)
    return probe, values


def _run(probe: nn.Module, values: dict[str, torch.Tensor], sizes: dict[str, list[str]], width: int, inputs: tuple):
    for name, value in values.items():
        owner, _, leaf = name.rpartition(".")
        probe.get_submodule(owner)._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    for path, attrs in sizes.items():
        for attr in attrs:
            setattr(probe.get_submodule(path), attr, width)
    return probe.forward(*inputs)


@torch.no_grad()
def probe_stacked(module: nn.Module, hidden: int, tp: int) -> tuple[dict[str, ExpertParam], dict[str, dict]] | str:
    """``({parameter (path relative to module): placement}, {submodule path: {attribute: local value}})``
    of stacked experts ``module`` at TP degree ``tp`` (see the module docstring), or why none."""
    count = stacked_count(module)
    width = next(module.parameters()).shape[0] // count
    if width % tp:
        return f"each expert's intermediate width {width} does not divide by tp={tp}"
    sizes = width_attrs(module, width)
    g = torch.Generator().manual_seed(0)
    keep = min(_PROBE_EXPERTS, count)
    try:
        probe, values = _cut(module, count, keep, g)
        inputs = probe_inputs(keep, hidden, KERNEL, g)
        want = _run(probe, values, sizes, width, inputs)
        total = torch.zeros_like(want)
        for rank in range(tp):
            pieces = {n: v.index_select(0, local_positions(v.shape[0], keep, tp, rank)) for n, v in values.items()}
            total += _run(probe, pieces, sizes, width // tp, inputs)
    except Exception as exc:  # noqa: BLE001 - a module not called like transformers' experts
        detail = " ".join(str(exc).split())[:120]
        return f"its stacked experts do not run split per expert ({type(exc).__name__}: {detail})"
    if (total - want).abs().max().item() > PROBE_RTOL * (want.abs().max().item() or 1.0):
        return (
            f"splitting each of its {count} stacked experts' width {width} over tp={tp} does not reproduce its output"
        )
    layout = {name: ExpertParam(0, count) for name in values}
    return layout, {path: {attr: width // tp for attr in attrs} for path, attrs in sizes.items()}
