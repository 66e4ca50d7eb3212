"""A row-parallel output read back inside the split region: its gradient summed over TP (``Plan.summed``).

Megatron pairs a column-parallel linear with a row-parallel one, whose all-reduced output is whole
on every rank and goes back to the residual stream. A Mamba-1 mixer (Mamba, Falcon-Mamba, Jamba) has
a row-parallel linear in its middle: ``x_proj`` (I -> dt_rank + 2N) reads the split channels and
sums them into whole dt, B and C (its output all-reduced, like any row-parallel output), which go
back into the split channels: ``dt_proj`` (dt_rank -> I, column-parallel again) turns dt into per-
channel time steps, and B and C meet each channel's state in the scan. Each rank's backward then
gives dt, B and C the gradient of its own channels only, a partial one. Summed over TP once, at
x_proj's output (the backward of its all-reduce is an all-reduce too: ``linear.Rowwise("summed")``), it is
whole again for x_proj's weight and input. In between, a module with parameters reading the region
(Jamba's RMSNorms of dt, B and C) computes gradients from partial ones: it is
``replicate_grad_allreduce`` (summed with the other TP-partial gradients after backward); a
column-parallel linear reading it takes its input as it is (``linear.LatentColwise``, as MLA's readers
of a latent: ``latent.py``): its input gradient is partial already, summed at the row-parallel output.

The trace (``track``) marks the tensors computed from a row-parallel output alone, while whole, in the
module holding it; one needing a gradient that meets split activations makes that output *summed*.
Where the region also meets a tensor needing a whole gradient (the residual stream, a parameter of a
module not reading it) or leaves the module holding the linear, part of its gradient is whole on
every rank, which the sum would count tp times: that is a violation (its sub-block kept replicated).

Also here: a linear whose weight its parent multiplies directly (``self.dt_proj.weight @ dt``, its
own forward never run) with whole activations is a column-parallel linear all the same
(``direct_product``): the product is split by the weight's rows (where ``x`` needs a gradient, only
inside such a region, which sums it). It gets the ``per_channel`` style
(weight and bias split by rows; the parent, ``per_channel`` too, computes on local views of them:
``channels.py``), and the parameters meeting the product along its rows (Mamba's ``A_log``) follow it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from shardlm.parallel.infer.broadcast import ELEMENTWISE
from shardlm.parallel.infer.refusals import not_splittable
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import Style

_MATMUL = {"matmul", "__matmul__"}


def direct_product(tracker, name: str, args: tuple, out) -> bool:
    """``W @ x`` with ``W`` the weight of a block linear (``tracker.direct_weights``) and ``x``
    whole: marks the product as that linear's column-parallel output, split along W's rows (dim -2)."""
    if name not in _MATMUL or len(args) < 2 or not isinstance(out, torch.Tensor):
        return False
    w, x = args[0], args[1]
    fqn = tracker.direct_weights.get(id(w))
    if fqn is None or not isinstance(x, torch.Tensor) or tracker.is_sharded(x) or out.dim() < 2:
        return False
    if w.dim() != 2 or out.shape[-2] != w.shape[0]:
        return False
    if x.requires_grad and id(x) not in tracker.rows:
        return False  # its gradient from this rank's rows would be partial, and nothing would sum it
    tracker.direct.add(fqn)
    tracker.widths[fqn] = w.shape[0]
    tracker.legit[tracker.param_owner[id(w)]] = True  # its bias, used directly too, is placed with it
    tracker.mark(out, frozenset({fqn}))
    tracker.layouts[id(out)] = (-2, (w.shape[0],))
    if x.requires_grad:
        tracker.rows_met |= tracker.rows.get(id(x), frozenset())
    return True


def track(tracker, name: str, inputs: list[torch.Tensor], sources: frozenset[str], out) -> None:
    """Follow the regions of row-parallel outputs (``tracker.rows``) through one op."""
    whole = [t for t in inputs if id(t) not in tracker.sharded]
    rows = frozenset().union(*(tracker.rows.get(id(t), frozenset()) for t in whole))
    if not rows:
        return
    if sources:  # it meets split activations: its gradient from this rank is a partial one
        tracker.rows_met |= frozenset().union(*(tracker.rows.get(id(t), frozenset()) for t in whole if t.requires_grad))
        # added to a column-parallel linear's own output of its shape: an adapter beside it (``latent.py``), unless
        # that linear is a misfit (``checks.py``, known once the trace ends: RWKV's receptance, multiplied into its
        # value); not any split tensor (Doge's experts' sum, made of the split router's top-k, is none)
        if name in ELEMENTWISE:
            shapes = {tuple(t.shape) for t in inputs if id(t) in tracker.projections}
            for t in (t for t in whole if tuple(t.shape) in shapes):
                for fqn in tracker.rows.get(id(t), ()):
                    tracker.rows_beside.setdefault(fqn, set()).add(sources)
        return
    readers = tuple(f"{r} (" for r in tracker.rows_readers)
    for t in whole:
        if id(t) in tracker.rows or not t.requires_grad:
            continue
        owners = (
            {tracker.param_owner.get(id(t), "?")} if isinstance(t, nn.Parameter) else tracker.from_params.get(id(t))
        )
        if owners and all(o.startswith(readers) for o in owners):
            continue  # a parameter of a module reading the region (its norm): summed over TP too
        for r in rows:
            tracker.rows_leaks.setdefault(r, f"{name} mixes it with a tensor computed whole on every rank")
        return
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            tracker.rows[id(t)] = rows


def track_output(tracker, name: str, out, rowwise: bool) -> None:
    """At the end of module ``name``'s forward: a region leaving the module holding its linear is a
    leak; a row-parallel linear's output starts its region."""
    for t in tree_flatten(out)[0]:
        for fqn in tracker.rows.get(id(t), ()) if isinstance(t, torch.Tensor) else ():
            if not name.startswith(f"{fqn.rpartition('.')[0]}."):
                tracker.rows_leaks.setdefault(fqn, f"{name} returns it")
    if rowwise and isinstance(out, torch.Tensor):
        tracker.rows[id(out)] = frozenset({name})


def place_summed(model: nn.Module, plan: Plan, summed: set[str], readers: dict[str, set[str]]) -> None:
    """``plan.summed`` and the styles of the modules reading their regions (see the module docstring)."""
    plan.summed = sorted(f for f in summed if plan.styles.get(f) == Style.ROWWISE)
    for fqn, rows in sorted(readers.items()):
        rows = rows & set(plan.summed)
        if not rows:
            continue
        style = plan.styles.get(fqn)
        if style == Style.COLWISE and fqn not in plan.sliced and fqn not in plan.stored_rows:
            plan.latent_readers[fqn] = min(rows)
        elif style == Style.REPLICATE:
            plan.styles[fqn] = Style.REPLICATE_GRAD_ALLREDUCE.value
        else:
            raise not_splittable(
                f"{fqn} ({type(model.get_submodule(fqn)).__name__}) reads the whole output of "
                f"{min(rows)} inside a split region as a {style} layer"
            )


def place_direct(model: nn.Module, plan: Plan, direct: set[str]) -> None:
    """The linears multiplied directly by their parent (``direct_product``): ``per_channel``, weight
    and bias split by rows (their own channels)."""
    for fqn in sorted(direct):
        if plan.styles.get(fqn) == Style.COLWISE and fqn not in plan.sliced and fqn not in plan.stored_rows:
            plan.styles[fqn] = Style.PER_CHANNEL.value
            plan.channels[fqn] = {n: fqn for n, _ in model.get_submodule(fqn).named_parameters(recurse=False)}


def declare_summed_records(tracker) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    # ``summed.py``: the weights of block linears a parent may multiply directly (id -> linear), those
    # found so; id(tensor) -> the row-parallel linears whose whole output it is computed from alone,
    # those whose region meets split activations, the modules with parameters reading it, its leaks
    tracker.direct_weights: dict[int, str] = {}
    tracker.direct: set[str] = set()
    tracker.rows: dict[int, frozenset[str]] = {}
    tracker.rows_met: set[str] = set()
    tracker.rows_readers: dict[str, frozenset[str]] = {}
    tracker.rows_leaks: dict[str, str] = {}
    # row-parallel outputs added to split outputs of their shape -> the linears each came from
    tracker.rows_beside: dict[str, set[frozenset[str]]] = {}
    tracker.projections: set[int] = set()  # ids of column-parallel linears' own outputs (``trace_hooks.py``)
    # column-parallel linears whose output is added to a whole activation of its shape -> why (``checks.py``)
    tracker.misfits: dict[str, str] = {}
