"""Mixture-of-experts layers whose experts are per-expert linear modules the layer calls itself: JetMoE's
``JetMoeMoE`` routes its tokens (``JetMoeTopKGating``, its expert counts read to the host), groups them by
expert and runs two ``JetMoeParallelExperts`` (one ``[E, out, in]`` weight each: ``input_linear``, gate and
up concatenated, then ``output_linear``), adding a bias after the weighted sum.

Split as a dense MLP's pair of linears, per expert: each expert's intermediate width over TP, the first
per-expert linear's output rows (its gate and up parts each on its own) and the second's input columns; the
bias added by one rank. The layer takes the ``experts`` style (its output a partial sum, all-reduced once),
its per-expert linear modules ``per_channel`` (their pieces read as local tensors while the layer runs), its
router whole on every rank: it routes every rank's tokens alike, and its gradient, which each rank computes
from its share of the experts' outputs only, is summed over TP (``Plan.partial_grads``).

Derived by a probe, not by names: a CPU copy of the layer cut to a few experts (every parameter of E leading
rows and every expert-count attribute), random fp64 values, run whole on random hidden states, then once per
TP rank on each candidate placement's pieces (``expert_split.options`` for the 3-D weights; once or whole for
the layer's own parameters); the first whose rank outputs sum to the whole output is the plan.

A routed layer whose forward does not run (JetMoE's mixture of attention heads, ``JetMoeMoA``, called through
``map``/``reduce`` by its attention layer) is probed through its parent, that attention layer, called with
its rotary ``position_embeddings`` too: each expert's query heads (``input_linear`` rows) split over TP with
the kv heads they read (``kv_proj``, a linear beside the routed layer, split by its output rows: k and v, 2
parts) and the matching ``output_linear`` columns, the bias added once, the router (one output per expert)
whole. Which int attributes size the split outputs (the MoA's ``hidden_size``, its queries' width in
``zeros(tokens * top_k, self.hidden_size)``; equal to the hidden width at tiny sizes, so not told by value) is
probed too: the fewest attributes of a split width that, made local, give the whole output
(``RoutedLayout.local_sizes``, ``Plan.local_sizes``). Its top-k router keeps the routing whole: every rank
routes every token alike.
"""

from __future__ import annotations

import copy
import inspect
import itertools

import torch
import torch.nn as nn

from shardlm.parallel.infer.expert_split import PROBE_RTOL, PROBE_TOKENS, options, rank_piece
from shardlm.parallel.model.experts import is_experts_like
from shardlm.parallel.model.hf import is_linear
from shardlm.parallel.plan.styles import ExpertParam

_PROBE_EXPERTS = 4


def routed_count(module: nn.Module) -> int | None:
    """E where ``module`` holds two or more per-expert linear modules (``is_experts_like``) of E experts each
    among its children; None otherwise."""
    counts = {next(m.parameters()).shape[0] for m in module.children() if is_experts_like(m)}
    linears = [m for m in module.children() if is_experts_like(m)]
    return counts.pop() if len(linears) >= 2 and len(counts) == 1 else None


def _cut(module: nn.Module, count: int, keep: int, g: torch.Generator) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A CPU copy of ``module`` (on meta) cut to ``keep`` experts: random fp64 values (the rows of its first
    experts where a parameter's leading size is the expert count), its expert-count attributes ``keep``."""
    probe = copy.deepcopy(module)
    values = {}
    for name, p in module.named_parameters():
        shape = (keep, *p.shape[1:]) if p.dim() >= 2 and p.shape[0] == count else tuple(p.shape)
        values[name] = torch.randn(shape, generator=g, dtype=torch.float64) / max(1, p.shape[-1]) ** 0.5
    for sub in probe.modules():
        sub._buffers = {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in sub._buffers.items() if b is not None}
        for attr, value in list(vars(sub).items()):
            if "expert" in attr and isinstance(value, int) and not isinstance(value, bool) and value == count:
                setattr(sub, attr, keep)
    return probe, values


class RoutedLayout(dict):
    """``{parameter path: placement}`` of a routed layer, with the widths its forward sizes its experts'
    split outputs by (``local_sizes``: submodule path -> {attribute: local value}; JetMoE's MoA makes its
    queries in ``zeros(tokens * top_k, self.hidden_size)``)."""

    local_sizes: dict[str, dict[str, int]]


def _run(probe: nn.Module, values: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    for name, value in values.items():
        owner, _, leaf = name.rpartition(".")
        probe.get_submodule(owner)._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    out = probe(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _call_kwargs(module: nn.Module, g: torch.Generator) -> dict:
    """What an attention layer calling a routed layer (JetMoE's, its queries made by the mixture of attention
    heads) is called with beside its hidden states: its rotary ``position_embeddings`` (cos, sin), no mask."""
    if "position_embeddings" not in inspect.signature(module.forward).parameters:
        return {}
    dim = getattr(module, "head_dim", None)
    rotary = [torch.randn(1, PROBE_TOKENS, dim, generator=g, dtype=torch.float64) for _ in range(2)]
    return {"position_embeddings": tuple(rotary), "attention_mask": None}


def _candidates(
    module: nn.Module, shapes: dict[str, tuple], hidden: int, tp: int, count: int
) -> list[list[ExpertParam]]:
    """Per parameter: a per-expert linear's weight split on a non-expert dim; the router's (a linear of one
    output per expert) whole; another linear's (JetMoE's ``kv_proj`` beside its routed queries) split by its
    output rows, in 1 or 2 parts (k and v concatenated); the layer's other parameters (a bias after the sum)
    added once, or whole."""
    found = []
    for name, shape in shapes.items():
        owner = module.get_submodule(name.rpartition(".")[0])
        if is_experts_like(owner):
            found.append(options(shape, hidden, tp, once=False))
        elif is_linear(owner) and shape[0] != count:
            found.append([ExpertParam(0, parts) for parts in (1, 2) if shape[0] % (tp * parts) == 0])
        elif is_linear(owner):
            found.append([ExpertParam(None)])
        else:
            found.append([ExpertParam(None, once=True), ExpertParam(None)])
    return found


def _width_choices(probe: nn.Module, layout: dict[str, ExpertParam], shapes: dict[str, tuple]) -> list[tuple]:
    """The sets of int attributes (submodule path, name) that may size the per-expert linears' split outputs,
    fewest first (none, one, two): those equal to a split width, expert counts aside."""
    widths = {shapes[n][p.dim] for n, p in layout.items() if p.dim is not None and n.count(".") > 1}
    attrs = [
        (path, attr)
        for path, sub in probe.named_modules()
        for attr, value in vars(sub).items()
        if type(value) is int and value in widths and "expert" not in attr
    ]
    return [c for k in range(3) for c in itertools.combinations(attrs, k)]


def _ranks_sum(probe, values, layout, x, kwargs, tp, sizes) -> torch.Tensor:
    """The sum of the tp ranks' outputs of ``probe`` on their pieces of ``layout``, ``sizes`` made local."""
    saved = {(path, attr): getattr(probe.get_submodule(path), attr) for path, attr in sizes}
    try:
        for (path, attr), value in saved.items():
            setattr(probe.get_submodule(path), attr, value // tp)
        total = 0
        for rank in range(tp):
            pieces = {name: rank_piece(values[name], param, tp, rank) for name, param in layout.items()}
            total = total + _run(probe, pieces, x, kwargs)
        return total
    finally:
        for (path, attr), value in saved.items():
            setattr(probe.get_submodule(path), attr, value)


@torch.no_grad()
def probe_routed(module: nn.Module, hidden: int, tp: int, count: int | None = None) -> RoutedLayout | str:
    """``{parameter path (relative to module): placement}`` of routed layer ``module`` (or of the attention
    layer calling one, ``count`` its experts) at TP degree ``tp`` whose per-rank outputs sum to its output
    (see the module docstring), or why there is none."""
    count = count or routed_count(module)
    g = torch.Generator().manual_seed(0)
    try:
        probe, values = _cut(module, count, min(_PROBE_EXPERTS, count), g)
        x = torch.randn(1, PROBE_TOKENS, hidden, generator=g, dtype=torch.float64)
        kwargs = _call_kwargs(module, g)
        want = _run(probe, values, x, kwargs)
    except Exception as exc:  # noqa: BLE001 - a layer not called on its hidden states alone
        detail = " ".join(str(exc).split())[:120]
        return f"it does not run on its hidden states alone ({type(exc).__name__}: {detail})"
    shapes = {name: tuple(v.shape) for name, v in values.items()}
    scale = want.abs().max().item() or 1.0
    for choice in itertools.product(*_candidates(module, shapes, hidden, tp, min(_PROBE_EXPERTS, count))):
        layout = RoutedLayout(zip(shapes, choice))
        for sizes in _width_choices(probe, layout, shapes):
            try:
                total = _ranks_sum(probe, values, layout, x, kwargs, tp, sizes)
            except Exception:  # noqa: BLE001 - a candidate whose local shapes the forward rejects
                continue
            if (total - want).abs().max().item() > PROBE_RTOL * scale and not sizes:
                break  # its shapes fit as they are, its numbers do not: local sizes would not mend them
            if (total - want).abs().max().item() <= PROBE_RTOL * scale:
                layout.local_sizes = {}
                for path, attr in sizes:
                    layout.local_sizes.setdefault(path, {})[attr] = getattr(module.get_submodule(path), attr) // tp
                return layout
    return f"no split of its per-expert linears' weights {shapes} over tp={tp} reproduces its output"


def find_routed(
    model: nn.Module, blocks: tuple[str, ...], hidden: int | None, tp: int
) -> dict[str, dict[str, ExpertParam]]:
    """The MoE layers whose experts are per-expert linear modules they call themselves (JetMoE's MLP,
    ``expert_layers.py``) that the probe splits, by fqn, with the placement of every parameter under them
    split or added once; the others are kept whole (``whole_moe_layers``)."""
    found: dict[str, dict[str, ExpertParam]] = {}
    probed: dict[tuple, dict | str] = {}
    for name, module in model.named_modules():
        if not hidden or not name.startswith(blocks) or routed_count(module) is None:
            continue
        key = (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))
        if key not in probed:
            probed[key] = probe_routed(module, hidden, tp)
        if isinstance(probed[key], str) and "." in name:  # called through map/reduce: its attention layer
            name, parent = name.rpartition(".")[0], model.get_submodule(name.rpartition(".")[0])
            key = (type(parent), tuple((n, tuple(p.shape)) for n, p in parent.named_parameters()))
            if key not in probed:
                probed[key] = probe_routed(parent, hidden, tp, routed_count(module))
        if not isinstance(probed[key], str):
            layout = RoutedLayout((n, p) for n, p in probed[key].items() if p.dim is not None or p.once)
            layout.local_sizes = probed[key].local_sizes
            found[name] = layout
    return found


def calls_routed(module: nn.Module) -> bool:
    """Whether ``module`` is a routed layer (``routed_count``) or the layer calling one through its own methods
    (JetMoE's attention, whose mixture of attention heads has no forward of its own)."""
    return routed_count(module) is not None or any(routed_count(c) is not None for c in module.children())
