"""The dry run: an inferred plan run on meta at one rank's shapes, before any rank is spawned.

The trace (``trace.py``) sees the model whole; some layouts only break, or silently regroup, once
each rank holds its own rows and head counts: head counts hard-wired into a reshape (Falcon's
multi-query ``num_heads + 2``), split sizes of a multi-query fused projection (GPT-BigCode), fused
projections grouped by a count the checkpoint fixes (CodeGen's ``mp_num`` groups of ``[q, v, k]``).
``autotp`` keeps the sub-block ``dry_run`` names replicated and infers again.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn as nn

from shardlm.parallel.infer.head_einsums import head_placements
from shardlm.parallel.infer.trace import Traced, meta_forward
from shardlm.parallel.infer.tracker import ShardTracker
from shardlm.parallel.model.hf import is_conv1d, is_linear, out_features
from shardlm.parallel.model.meta import build_meta
from shardlm.parallel.plan.channels import channel_dim, param_rows
from shardlm.parallel.plan.head_inputs import slice_head_inputs
from shardlm.parallel.plan.local_geometry import WIDTH_ATTRS, localize_geometry, localize_geometry_of, own_geometry
from shardlm.parallel.plan.local_reshape import asks_whole_width, reshape_locally
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import SPLIT_LINEAR


def dry_run(
    model: nn.Module, plan: Plan, tp: int, traced: Traced, probes: dict[str, nn.Module] | None = None
) -> tuple[str, str] | None:
    """Run the forward on meta at rank 0's shapes: split linears hold their local rows/columns,
    attention modules their local head counts (``localize_geometry``), as the ranks will.

    Returns ``(module, why)`` for the sub-block that breaks, or None. This catches layouts that a
    global trace cannot see: head counts hard-wired into a reshape (Falcon's multi-query
    ``num_heads + 2``), split sizes of a multi-query fused projection (GPT-BigCode), and fused
    projections grouped by a count the checkpoint fixes (CodeGen's ``mp_num`` groups of
    ``[q, v, k]``: the local reshape still runs, but its groups change size, so it is compared
    with the global trace's; run again with the module's widths whole, see the module docstring)."""
    failure, regrouped = _run(model, plan, tp, traced, probes)
    while failure is not None and regrouped is None and _reshapes_whole(model, plan, tp, failure):
        failure, regrouped = _run(model, plan, tp, traced, probes)  # TrOCR's output reshaped to its input's width
    if regrouped is None:
        return failure
    first, kept = (failure, regrouped), {}
    while regrouped is not None and regrouped[0] not in kept:  # every block's module alike, one by one
        whole = _localized_widths(model, plan, tp, regrouped[0])
        if not whole:
            break
        kept[regrouped[0]] = whole
        plan.local_sizes.setdefault(regrouped[0], {}).update(whole)
        failure, regrouped = _run(model, plan, tp, traced, probes)
        if failure is None:
            return None  # each rank views its columns into whole groups, fewer of them
    if not kept:
        return first[0]  # no width of its module sizes the groups (Moshi's ``view(..., 2, -1)``)
    for owner, whole in kept.items():
        for attr in whole:
            plan.local_sizes[owner].pop(attr)
        if not plan.local_sizes[owner]:
            plan.local_sizes.pop(owner)
    (owner, why), (_, groups, size) = first
    fused = why.split(" is fused")[0]
    return owner, (
        f"{fused} is fused in {groups} groups of {size} columns fixed by the checkpoint, which tp={tp} does not divide"
    )


def split_if_exact(model: nn.Module, plan: Plan, tp: int, traced: Traced, place: Callable[[], object]) -> bool:
    """Apply ``place`` (a split set on ``plan``'s tables after the trace: an indexer's heads, a shared key=value
    attention's query heads) and keep it where the dry run accepts it; else put every table of the plan back
    as it was (each copied one level deep: ``place`` adds entries, it does not edit those already there)."""
    saved = {f.name: copy.copy(getattr(plan, f.name)) for f in dataclasses.fields(plan)}
    place()
    if dry_run(model, plan, tp, traced) is None:
        return True
    for name, table in saved.items():
        setattr(plan, name, table)
    return False


def _reshapes_whole(model: nn.Module, plan: Plan, tp: int, failure: tuple[str, str]) -> bool:
    """Where split attention ``owner`` failed reshaping its heads' output to the whole width read off its input
    (TrOCR's ``reshape(bsz, tgt_len, embed_dim)``, ``embed_dim`` from ``hidden_states.size()``), plan every
    attention module of its class to reshape to a rank's share (``Plan.local_reshapes``) and say so; False
    where that is not why it failed, or it already does."""
    owner, why = failure
    if owner not in plan.attention or owner in plan.local_reshapes:
        return False
    module = model.get_submodule(owner)
    heads, _, head_dim = own_geometry(module, owner, plan)
    if not heads * head_dim or not asks_whole_width(why, heads * head_dim, tp):
        return False
    for name in plan.attention:
        if type(model.get_submodule(name)) is type(module):
            plan.local_reshapes[name] = heads * head_dim
    return True


def _localized_widths(model: nn.Module, plan: Plan, tp: int, owner: str) -> dict[str, int]:
    """The head-concatenation widths of ``owner`` that ``localize_geometry`` divides: their whole values."""
    if owner not in plan.attention or not plan.geometry.heads:
        return {}
    module = model.get_submodule(owner)
    local = copy.copy(module)
    localize_geometry_of(local, owner, plan, tp)
    return {a: getattr(module, a) for a in WIDTH_ATTRS if getattr(local, a, None) != getattr(module, a, None)}


def _run(
    model: nn.Module, plan: Plan, tp: int, traced: Traced, probes: dict[str, nn.Module] | None
) -> tuple[tuple[str, str] | None, tuple[str, int, int] | None]:
    """The dry run's failure (``dry_run``) and, for a fused projection regrouped by its local view,
    (its module, the number of its groups whole, their size)."""
    meta = build_meta(model, eager=False)
    slice_head_inputs(meta, plan, tp, 0)  # before the local head counts (``build.apply_tp``)
    localize_geometry(meta, plan, tp)
    reshape_locally(meta, plan, tp)
    for fqn, params in head_placements(meta, plan).items():  # XLNet's per-head parameters: their heads
        module = meta.get_submodule(fqn)
        for pname, placed in params.items():
            shape = list(getattr(module, pname).shape)
            shape[placed.dim] //= tp
            setattr(module, pname, nn.Parameter(torch.empty(shape, device="meta")))
    for fqn, style in plan.styles.items():
        module = meta.get_submodule(fqn)
        conv1d = is_conv1d(module)
        if style in ("colwise", "packed_colwise") and is_linear(module):
            held = plan.sliced.get(fqn) or plan.stored_rows.get(fqn)  # rank 0's rows where they are given
            rows = sum(b - a for a, b in held[0]) if held else out_features(module) // tp
            shape = list(module.weight.shape)
            shape[1 if conv1d else 0] = rows
            module.weight = nn.Parameter(torch.empty(shape, device="meta"))
            if module.bias is not None:
                module.bias = nn.Parameter(torch.empty(rows, device="meta"))
            if conv1d:
                module.nf = rows
        elif style == "rowwise" and is_linear(module):
            shape = list(module.weight.shape)
            shape[0 if conv1d else 1] //= tp
            module.weight = nn.Parameter(torch.empty(shape, device="meta"))
            if fqn in plan.narrowed:  # one value per head: this rank's heads' columns (``narrowed.py``)
                module.forward = lambda x, m=module: type(m).forward(m, x)[..., : out_features(m) // tp]
        elif style == "sharded_norm":
            if getattr(module, "weight", None) is not None:  # a parameter-free norm has none (Dory's L2 norm)
                module.weight = nn.Parameter(torch.empty(module.weight.shape[0] // tp, device="meta"))
            module.forward = lambda x, gate=None: x  # ``replicate.ShardedRMSNorm`` keeps the shape (groups by width)
        elif style == "per_channel":
            for pname in plan.channels.get(fqn, {}):
                shape = list(getattr(module, pname).shape)
                rows = param_rows(plan, fqn, pname)
                d = channel_dim(plan, fqn, pname, getattr(module, pname))
                shape[d] = sum(b - a for a, b in rows[0]) if rows is not None else shape[d] // tp
                setattr(module, pname, nn.Parameter(torch.empty(shape, device="meta")))
    stack: list[str] = []
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in meta.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        hooks.append(module.register_forward_hook(lambda m, a, o, name=name: _pop(stack, name, o, outputs)))
    tracker = ShardTracker()
    try:
        with tracker:
            meta_forward(meta, probes=probes)
    except Exception as exc:  # noqa: BLE001 - a shape error at local shapes: this sub-block cannot be split
        owner = _owner_of_split_linears(plan, stack)
        detail = " ".join(str(exc).split())[:120]
        return (
            owner,
            f"{owner} ({type(meta.get_submodule(owner)).__name__}) fails at one rank's shapes ({detail})",
        ), None
    finally:
        for h in hooks:
            h.remove()
    for fqn, global_view in traced.views.items():
        out = outputs.get(fqn)
        if out is None or fqn not in plan.styles or not global_view:
            continue
        local_view = tracker.first_view.get(id(out), ())[out.dim() :]
        if local_view and local_view != global_view:
            owner = fqn.rpartition(".")[0]
            why = (
                f"{fqn} ({type(meta.get_submodule(fqn)).__name__}) is fused in groups whose size depends on the "
                f"split (reshaped to {global_view} whole, {local_view} per rank): its layout is fixed by the "
                "checkpoint"
            )
            size = math.prod(global_view)
            return (owner, why), (owner, out_features(model.get_submodule(fqn)) // size, size)
    return None, None


def _pop(stack: list[str], name: str, out, outputs: dict) -> None:
    if stack and stack[-1] == name:
        stack.pop()
    if isinstance(out, torch.Tensor):
        outputs[name] = out


def _owner_of_split_linears(plan: Plan, stack: list[str]) -> str:
    """The innermost running module that owns split linears (or the parent of a running one)."""
    split = {f for f, s in plan.styles.items() if s in SPLIT_LINEAR}
    parents = {f.rpartition(".")[0] for f in split}
    for name in reversed(stack):
        if name in split:
            return name.rpartition(".")[0]
        if name in parents:
            return name
    return stack[-1] if stack else ""
