"""Attention computed by einsums of per-head parameters, no linear layer: split by heads like one.

XLNet's relative attention holds its projections as parameters ``[d_model, heads, head_dim]`` (q, k, v,
o, r) and per-head biases ``[heads, head_dim]`` (``r_w_bias``, ...) or tables ``[2, heads, head_dim]``
(``seg_embed``), and computes with ``torch.einsum``. The trace (``tracker.py``) sees no linear there; this
module teaches it those einsums, by the parameters' shapes and the equations' subscripts, no name read:

* a *per-head parameter* is one of a module holding no linear, inside the decoder blocks, all of whose own
  parameters have a head-count dim followed by a head-width last dim (``heads_dim``);
* an einsum that keeps that head dim in its output splits it (``reads_whole`` where the other operands are
  whole: q, k, v, r projecting the residual stream, like a column-parallel linear; within the heads where
  they are split already, as ``seg_embed`` meeting the queries);
* one that sums over it, reading a tensor split along the same subscript (``o``: ``ibnd,hnd->ibh``), gives
  the whole output once the ranks' partial sums are added (``sums_heads``, like a row-parallel linear);
* the per-head parameters met elementwise by activations split at the same dim (``q_head + r_w_bias``)
  follow the heads (``heads_aligned``).

The plan (``place_head_einsums``) gives the module the ``per_channel`` style, every own parameter split
along its head dim (``head_placements``: ``Plan.experts``), and records each traced parameter's role
(``Plan.head_einsums``); at run time the ranks' partial sums and the whole inputs' gradients are added over
TP where the einsums are (``runtime/head_einsums.py``): XLNet's ``post_attention`` applies dropout and the
residual right after its output einsum, in the same method, so there is no module boundary where a
row-parallel style could.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlm.parallel.model.hf import all_head_widths, head_counts, is_linear
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import ExpertParam

READS_WHOLE, SUMS_HEADS, WITHIN_HEADS = "reads_whole", "sums_heads", "within_heads"


def heads_dim(p: torch.Tensor, heads: set[int], widths: set[int]) -> int | None:
    """The head dim of a per-head parameter ``[..., heads, head_dim]`` (a head count, then a head width
    last), or None."""
    if p.dim() < 2 or p.shape[-2] not in heads or p.shape[-1] not in widths:
        return None
    return p.dim() - 2


def per_head_modules(model: nn.Module, prefixes: tuple[str, ...], forced: frozenset[str] = frozenset()) -> list[str]:
    """The modules inside the decoder blocks (``prefixes``) holding no linear whose own parameters are all
    per-head (``heads_dim``), none kept whole (``forced``: by the parameter's fqn)."""
    heads, widths = {h for h in head_counts(model.config) if h > 1}, all_head_widths(model.config)
    found = []
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own or not name.startswith(prefixes) or any(is_linear(m) for m in module.modules()):
            continue
        if (
            all(heads_dim(p, heads, widths) is not None for _, p in own)
            and not {f"{name}.{n}" for n, _ in own} & forced
        ):
            found.append(name)
    return found


def declare_head_einsum_records(tracker) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    # id(per-head parameter) -> (its module, its name, its head dim): set by ``trace_model``
    tracker.head_params: dict[int, tuple[str, str, int]] = {}
    # module -> {parameter: its role in the einsums that read it}: READS_WHOLE, SUMS_HEADS or WITHIN_HEADS
    tracker.head_einsums: dict[str, dict[str, str]] = {}


def watch_per_head(tracker, model: nn.Module, modules: list[str]) -> None:
    """Register the per-head parameters of ``modules`` (``per_head_modules``) for the trace of ``model``."""
    heads, widths = {h for h in head_counts(model.config) if h > 1}, all_head_widths(model.config)
    for name in modules:
        for pname, p in model.get_submodule(name).named_parameters(recurse=False):
            tracker.head_params[id(p)] = (name, pname, heads_dim(p, heads, widths))


def head_einsum(tracker, args: tuple, out) -> bool:
    """An einsum of one per-head parameter (see the module docstring): mark its output split along the
    head dim's subscript, or whole where it sums over it a tensor split there, and record the parameter's
    role. False where it is no such einsum (the tracker goes on as for any op)."""
    if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], str) or "->" not in args[0]:
        return False
    lhs, rhs = args[0].replace(" ", "").split("->")
    operands = list(args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
    specs = lhs.split(",")
    found = [i for i, t in enumerate(operands) if isinstance(t, torch.Tensor) and id(t) in tracker.head_params]
    if len(found) != 1 or len(specs) != len(operands):
        return False
    module, pname, dim = tracker.head_params[id(operands[found[0]])]
    letter = specs[found[0]][dim]
    others = [(s, t) for i, (s, t) in enumerate(zip(specs, operands)) if i != found[0]]
    sources = frozenset().union(*(tracker.sources(t) for _, t in others))
    if letter in rhs:
        role = WITHIN_HEADS if sources else READS_WHOLE
        tracker.mark(out, sources | {f"{module}.{pname}"})
        tracker.layouts[id(out)] = (rhs.index(letter) - len(rhs), (out.shape[rhs.index(letter)],))
    elif all(_split_at(tracker, s, t, letter) for s, t in others):
        role = SUMS_HEADS
        tracker.mark(out, None)
    else:
        return False  # a sum over heads of whole tensors: left to the tracker's checks
    roles = tracker.head_einsums.setdefault(module, {})
    if roles.setdefault(pname, role) != role:
        tracker.violations.append(
            (sources | {f"{module}.{pname}"}, f"{module}.{pname} is read both {roles[pname]} and {role}")
        )
    tracker.legit[tracker.param_owner.get(id(operands[found[0]]), "?")] = True
    return True


def _split_at(tracker, spec: str, t, letter: str) -> bool:
    """Whether ``t`` (subscripts ``spec``) is split along ``letter``'s dim."""
    layout = tracker.layouts.get(id(t)) if tracker.is_sharded(t) else None
    return layout is not None and len(spec) == t.dim() and spec[layout[0]] == letter


def heads_aligned(tracker, t: torch.Tensor, sharded: list[torch.Tensor]) -> bool:
    """Whether per-head parameter ``t``, of a module whose einsums split its heads already, meets split
    activations at their split dim with its head dim (``q_head + r_w_bias``: ``[.., heads, head_dim]``
    broadcast over ``[i, b, heads, head_dim]``)."""
    if id(t) not in tracker.head_params or tracker.head_params[id(t)][0] not in tracker.head_einsums:
        return False
    dim = tracker.head_params[id(t)][2] - t.dim()  # counted from the end, as layouts are
    return all(tracker.layouts.get(id(s), (None,))[0] == dim for s in sharded)


def place_head_einsums(model: nn.Module, plan: Plan, roles: dict[str, dict[str, str]]) -> None:
    """The modules whose per-head einsums the trace split (``roles``): ``per_channel``, every own parameter
    split along its head dim, attention modules of the plan (their head count localized)."""
    for fqn, found in roles.items():
        if SUMS_HEADS in found.values():  # else never summed back over the heads: not split
            plan.styles[fqn] = "per_channel"
            plan.head_einsums[fqn] = {n: r for n, r in found.items() if r != WITHIN_HEADS}
    plan.attention = sorted({*plan.attention, *plan.head_einsums})


def head_placements(model: nn.Module, plan: Plan) -> dict[str, dict[str, ExpertParam]]:
    """The ``Plan.experts`` entries of ``plan.head_einsums``' modules: every own parameter split along its
    head dim (the dry run shapes them so; the ``per_channel`` style places them so)."""
    heads, widths = {h for h in head_counts(model.config) if h > 1}, all_head_widths(model.config)
    return {
        fqn: {
            n: ExpertParam(heads_dim(p, heads, widths))
            for n, p in model.get_submodule(fqn).named_parameters(recurse=False)
        }
        for fqn in plan.head_einsums
    }
