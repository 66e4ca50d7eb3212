"""Mixture-of-experts layers under tensor parallelism: which modules hold experts, and how each of
their parameters splits, derived from the model (a probe run), not from a table of names.

transformers 5 stores a layer's experts fused, as 3-D parameters (Qwen3-MoE's
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; gpt-oss's transposed
``gate_up_proj [E, H, 2I]`` with gate and up interleaved, ``down_proj [E, I, H]``, and biases),
and runs them with whichever ``experts_implementation`` is active (an eager loop over the hit
experts, batched or grouped matmuls); every kernel takes ``(hidden_states, top_k_index,
top_k_weights)`` and returns the weighted sum of the chosen experts' outputs. Llama 4's experts take
the hidden states alone, the routing folded in (every expert's copy of the rows, scaled by the
router's score for it), Inkling's shared experts the hidden states and every token's weight of each expert
(``model.experts.experts_call``); the probe calls them so, the split is the same.

Under TP (the ``experts`` style, ``runtime.experts.ExpertsParallel``) each expert's intermediate dim is split:
rank r holds its chunk of the gate half and of the up half of ``gate_up_proj`` (each part on its
own, like ``packed_colwise``, so the kernel's local ``chunk(2)`` still pairs gate with up) and the
matching input columns of ``down_proj``; a bias after the down projection is added by one rank.
Every rank runs the module's own forward, whatever the kernel, on its local pieces: its output
is a partial sum, all-reduced once, the way a row-parallel down projection's is.

Found: a module inside the decoder blocks whose own parameters all share one leading size E > 1,
at least two of them 3-D. Derived: ``probe_layout`` runs a CPU copy of the module, cut to a few
experts with random fp64 values, through its eager forward on random hidden states, expert
indices and routing weights; then, for each candidate placement, once per TP rank on that rank's
pieces. The first candidate whose rank outputs sum to the whole module's output is the plan.
Candidates: each 3-D parameter sharded on one of its two non-expert dims, in 1 or 2 parts; a 2-D
one (a bias ``[E, X]``) likewise on dim 1, or whole and added once; preferred first: the dims
that are not the hidden width, 1 part before 2, a hidden-width bias added once. So which
parameter is the in- or out-projection, which dim is the intermediate one and whether gate and
up are concatenated (``chunk(2)``: 2 parts) or interleaved (``[..., ::2]``: 1 part) is what the
module computes, not what its names or a kernel say; and the plan does not depend on the active
kernel (the probe runs eager; every kernel computes the same function).

What is not found so is kept whole on every rank, with its model's property as the reason
(``whole_moe_layers``): a layer whose class names it a mixture of experts / router
(``...SparseMoeBlock``, ``...Experts``, ``...MoA``) outside a handled MoE block (JetMoE's mixture of
attention heads is one: its attention layer is probed, ``expert_layers.py``; Doge's experts as embedding rows,
LongCat-Flash's zero-computation experts); an expert
count in the config of a model in which no experts module was found is refused before spawning.
"""

from __future__ import annotations

import copy
import itertools
import re

import torch
import torch.nn as nn

from shardlm.parallel.infer.expert_blocks import probe_stacked, stacked_count, width_attrs
from shardlm.parallel.infer.expert_layers import calls_routed, find_routed
from shardlm.parallel.infer.expert_split import PROBE_RTOL, options, probe_inputs, rank_piece
from shardlm.parallel.infer.refusals import any_block, cannot_split
from shardlm.parallel.model.experts import (
    EVERY_TOKEN,
    FOLDED,
    KERNEL,
    block_prefixes,
    count_attrs,
    experts_call,
    is_experts_like,
    is_experts_module,
)
from shardlm.parallel.model.hf import config_size, config_value, is_linear
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import ExpertParam, Style

# class names of mixture-of-experts (and mixture-of-attention) layers
_MOE_CLASS = re.compile(r"Mo[EeA](?![a-z])|Mo[EeA][A-Z]|Expert|Router")


_MOE_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


_PROBE_EXPERTS = 4  # experts kept in the probe copy


def find_experts(model: nn.Module, tp: int) -> dict[str, dict[str, ExpertParam]]:
    """``{experts module fqn: {parameter: placement}}`` of ``model`` at TP degree ``tp``; raises
    ``ConfigError`` for an experts module no placement splits exactly (other mixture-of-experts layers are
    kept whole: ``whole_moe_layers``). A router's jitter needs nothing here: its
    draws are keyed like dropout (``runtime/dropout.py``), the same on every TP rank."""
    hidden = config_size(model.config, "hidden_size")
    blocks = block_prefixes(model)
    found: dict[str, dict[str, ExpertParam]] = {}
    probed: dict[tuple, dict[str, ExpertParam] | str] = {}
    for name, module in model.named_modules():
        if not name.startswith(blocks) or not is_experts_module(module):
            continue
        key = (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)))
        if key not in probed:
            probed[key] = probe_layout(module, hidden, tp) if hidden else "the model's config has no hidden_size"
        layout = probed[key]
        if isinstance(layout, str):
            raise cannot_split(f"{any_block(name)} ({type(module).__name__}): {layout}")
        found[name] = layout
    found.update(_stacked(model, blocks, hidden, tp, found))
    found.update(find_routed(model, blocks, hidden, tp))
    return found


def _stacked(
    model: nn.Module, blocks: tuple[str, ...], hidden: int | None, tp: int, fused: dict
) -> dict[str, dict[str, ExpertParam]]:
    """The experts modules whose experts are stacked in a submodule (DBRX, ``expert_blocks.py``), by fqn,
    with the placement of every parameter under them; refused in one line where the probe splits none."""
    found: dict[str, dict[str, ExpertParam]] = {}
    probed: dict[tuple, tuple | str] = {}
    for name, module in model.named_modules():
        if not hidden or not name.startswith(blocks) or name in fused or not _MOE_CLASS.search(type(module).__name__):
            continue
        if stacked_count(module) is None:
            continue
        key = (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))
        if key not in probed:
            probed[key] = probe_stacked(module, hidden, tp)
        if isinstance(probed[key], str):
            raise cannot_split(f"{any_block(name)} ({type(module).__name__}): {probed[key]}")
        found[name] = probed[key][0]
    return found


def own_forward_routers(model: nn.Module, experts: dict[str, dict[str, ExpertParam]]) -> dict[str, str]:
    """The linear layers of the MoE blocks holding ``experts`` that have a forward of their own (Phi-MoE's
    router, an ``nn.Linear`` subclass returning its logits with the experts it samples): the trace would
    take one for a split linear layer; it is computed whole on every rank like any router. ``{fqn: why}``."""
    blocks = {fqn.rpartition(".")[0] for fqn in experts}
    return {
        fqn: f"{type(module).__name__} is a router, a linear layer with its own forward, computed whole by each rank"
        for fqn, module in model.named_modules()
        if fqn.rpartition(".")[0] in blocks and is_linear(module) and type(module).forward is not nn.Linear.forward
    }


def place_experts(plan: Plan, experts: dict[str, dict[str, ExpertParam]], model: nn.Module, tp: int) -> None:
    """Put ``experts`` (``find_experts``) into ``plan``: the ``experts`` style and placements, and
    ``replicate_local`` for the other whole modules of their MoE blocks (the router): those compute
    on plain tensors with local views of their parameters, so buffers the block's routing code
    reads (DeepSeek-V3's ``e_score_correction_bias``) stay plain tensors, not DTensors. Experts stacked
    in a submodule (DBRX): that submodule ``per_channel`` on its pieces, the widths the experts module
    views them by local (``Plan.local_sizes``)."""
    plan.experts = dict(experts)
    blocks = {fqn.rpartition(".")[0] for fqn in experts}
    for fqn, style in plan.styles.items():
        if fqn in experts:
            plan.styles[fqn] = Style.EXPERTS.value
        elif fqn.rpartition(".")[0] in blocks and style == Style.REPLICATE:
            plan.styles[fqn] = Style.REPLICATE_LOCAL.value
    for fqn, layout in experts.items():
        if any("." in name for name in layout):
            _place_stacked(plan, model, fqn, layout, tp)
    plan.styles = {fqn: plan.styles[fqn] for fqn, _ in model.named_modules() if fqn in plan.styles}  # model order


def _place_stacked(plan: Plan, model: nn.Module, fqn: str, layout: dict[str, ExpertParam], tp: int) -> None:
    """Experts in submodules: the module ``experts`` with its own parameters' placements, the submodules
    holding the experts ``per_channel`` (their own pieces). Stacked (``expert_blocks.py``): the widths local;
    per-expert linears called by the layer (``expert_layers.py``): nothing more."""
    plan.styles[fqn], plan.experts[fqn] = Style.EXPERTS.value, {}
    for name, param in layout.items():
        owner, _, leaf = name.rpartition(".")
        if not owner:
            plan.experts[fqn][leaf] = param
            continue
        sub = f"{fqn}.{owner}"
        plan.styles[sub] = Style.PER_CHANNEL.value
        plan.experts.setdefault(sub, {})[leaf] = param  # its pieces read as local tensors by the experts module
        if param.once:
            plan.experts[fqn][name] = param  # added by one rank: the experts module mutes it on the others
    module = model.get_submodule(fqn)
    for path, sizes in getattr(layout, "local_sizes", {}).items():  # JetMoE's MoA: its queries' width
        plan.local_sizes.setdefault(f"{fqn}.{path}".rstrip("."), {}).update(sizes)
    if stacked_count(module) is None:
        return  # its router's gradient is summed over TP (``runtime.grads.tp_partial_grad_params``)
    width = next(module.parameters()).shape[0] // stacked_count(module)
    for path, attrs in width_attrs(module, width).items():
        local = plan.local_sizes.setdefault(f"{fqn}.{path}".rstrip("."), {})
        local.update({attr: width // tp for attr in attrs})


def whole_moe_layers(model: nn.Module, handled: dict | set) -> dict[str, str]:
    """Mixture-of-experts layers other than the ``handled`` experts modules and the MoE blocks holding them
    (their routers and shared experts are ordinary modules the trace places; the decoder layers around them
    are fine), ``{fqn: why}``: kept whole on every rank, each for its model's property (``_unsplit_experts``).
    Found by class name less the model's family prefix (``Qwen3Moe``: its attention is no MoE layer):
    ``...SparseMoeBlock``, ``...Experts``, ``...Router``, JetMoE's ``MoA`` inside the decoder blocks, the
    outermost of nested ones. A model with an expert count in its config where no experts module was
    handled nor kept whole is refused (``cannot_split``)."""
    blocks = block_prefixes(model)
    # the MoE blocks: the fused experts' parents, a layer calling per-expert linears itself
    owners = tuple(
        f"{name if calls_routed(model.get_submodule(name)) else name.rpartition('.')[0]}." for name in handled
    )
    family = re.sub(r"For\w+$", "", type(model).__name__)  # Qwen3Moe: every class of the family starts so
    whole: dict[str, str] = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        covered = f"{name}.".startswith(owners) or any(owner.startswith(f"{name}.") for owner in owners)
        inside = any(name.startswith(f"{w}.") for w in whole)
        if name.startswith(blocks) and not covered and not inside and _MOE_CLASS.search(cls.removeprefix(family)):
            whole[name] = f"{cls} is a mixture-of-experts layer {_unsplit_experts(module)}"
    if handled or whole:
        return whole
    configs = [model.config, config_value(model.config, "text_config")]
    for key in _MOE_COUNTS:
        counts = [config_value(c, key) for c in configs if c is not None]
        count = max((n for n in counts if isinstance(n, int)), default=0)
        if count > 1 and not any(config_value(c, "is_moe") is False for c in configs if c is not None):
            raise cannot_split(
                f"{type(model).__name__} is a mixture-of-experts model ({key}={count}) in which shardlm finds no "
                "fused experts module"
            )
    return whole


def _unsplit_experts(module: nn.Module) -> str:
    """What about MoE layer ``module``'s experts keeps it whole on every rank (the reason's words)."""
    own = {n: tuple(p.shape) for n, p in module.named_parameters() if p.dim() == 3}
    if len(own) >= 2 and len({s[0] for s in own.values()}) > 1:
        counts = ", ".join(f"{n.rpartition('.')[2]} {s[0]}" for n, s in own.items())
        return (
            f"whose zero-computation experts ({counts} experts) pass their tokens through inside the experts' sum, "
            "which every TP rank's partial sum would add again"
        )
    rows = [n for n, m in module.named_modules() if isinstance(m, nn.Embedding)]
    if rows:
        return f"whose experts are rows of embeddings ({', '.join(rows)}), each one neuron: no width to split over TP"
    linears = sorted({type(m).__name__ for m in module.modules() if m is not module and is_experts_like(m)})
    if linears:
        return (
            f"whose experts are per-expert linear modules ({', '.join(linears)}) it routes itself, its token counts "
            "read to the host"
        )
    return "whose experts are not fused 3-D parameters of one expert count"


def _probe_copy(module: nn.Module, experts: int, g: torch.Generator) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A CPU copy of ``module`` cut to ``experts`` experts, random fp64 parameters, eager kernel
    (shallow: its submodules, activations, are shared; nothing of ``module`` is changed or copied
    whole, so a real model's experts cost only the few kept)."""
    probe = copy.copy(module)
    probe._parameters, values = {}, {}
    for name, p in module.named_parameters(recurse=False):
        shape = (experts, *p.shape[1:])
        values[name] = torch.randn(shape, generator=g, dtype=torch.float64) / max(1, p.shape[-1]) ** 0.5
        probe._parameters[name] = nn.Parameter(values[name], requires_grad=False)
    probe._buffers = {n: torch.zeros(b.shape, dtype=b.dtype) if b.is_meta else b for n, b in module._buffers.items()}
    for name in count_attrs(module):
        setattr(probe, name, experts)  # num_experts
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "_experts_implementation"):
        probe.config = copy.deepcopy(config)
        probe.config._experts_implementation = "eager"
    return probe, values


_CALLS = {  # how ``model.experts.experts_call`` says each kind is called (the refusal's words)
    KERNEL: "(hidden_states, top_k_index, top_k_weights)",
    FOLDED: "(hidden_states) with every expert's rows stacked",
    EVERY_TOKEN: "(hidden_states, every token's expert weights)",
}


@torch.no_grad()
def probe_layout(module: nn.Module, hidden: int, tp: int) -> dict[str, ExpertParam] | str:
    """The placement of each parameter of experts ``module`` at TP degree ``tp`` whose per-rank
    outputs sum to the module's output (see the module docstring), or why there is none."""
    g = torch.Generator().manual_seed(0)
    experts = min(_PROBE_EXPERTS, next(module.parameters()).shape[0])
    call = experts_call(module)
    try:
        probe, values = _probe_copy(module, experts, g)
        inputs = probe_inputs(experts, hidden, call, g)
        want = probe.forward(*inputs)
    except Exception as exc:  # noqa: BLE001 - a module that is not called like transformers' experts
        detail = " ".join(str(exc).split())[:120]
        return f"its forward does not run as {_CALLS[call]} ({type(exc).__name__}: {detail})"
    x = inputs[0]
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return "its forward does not return one tensor shaped like its hidden states"
    scale = want.abs().max().item() or 1.0
    shapes = {name: tuple(v.shape) for name, v in values.items()}
    candidates = [options(shape, hidden, tp) for shape in shapes.values()]
    for choice in itertools.product(*candidates):
        layout = dict(zip(shapes, choice))
        total = torch.zeros_like(want)
        try:
            for rank in range(tp):
                for name, param in layout.items():
                    piece = rank_piece(values[name], param, tp, rank)
                    probe._parameters[name] = nn.Parameter(piece, requires_grad=False)
                total += probe.forward(*inputs)
        except Exception:  # noqa: BLE001 - a candidate whose local shapes the forward rejects
            continue
        if (total - want).abs().max().item() <= PROBE_RTOL * scale and any(p.dim is not None for p in choice):
            return layout
    return (
        f"no split of its parameters {shapes} over tp={tp} reproduces its output (per expert: an intermediate "
        "width split in 1 or 2 parts, a bias after the sum added once)"
    )
