"""Stretches of a linear's output held whole on every rank: found contracted over their split channels.

Mamba-2 computes its B and C (stretches of ``in_proj``'s output, x|B|C) in ``n_groups`` groups; at
fewer groups than tp, an einsum sums them over their split state dim, and each rank would sum its
own channels only. The trace records such a contraction (``record_contraction``) where the tensor is
one stretch of a linear's output (its ``layouts.Cuts`` origin); ``autotp`` then holds that stretch
whole on every rank (``Plan.sliced`` rows, as kv heads fewer than tp are) and traces again with it
in ``ShardTracker.wholes``: the tensors cut to it are whole, no longer split (``hold_whole``), and
the packed linear's or following parameter's parts say which are whole (``whole_flags``).
"""

from __future__ import annotations

from torch.utils._pytree import tree_flatten


def record_contraction(tracker, args: tuple) -> None:
    """An einsum summing a split tensor over its split dim (Mamba-2's B and C at n_groups < tp, over
    their state dim: each rank would sum its own channels only). Where that tensor is one stretch of a
    linear's output (its ``Cuts`` origin), the stretch is held whole on every rank (``found_wholes``:
    ``Plan.sliced`` rows, traced again), as kv heads fewer than tp are."""
    if not args or not isinstance(args[0], str) or "->" not in args[0] or "." in args[0]:
        return
    lhs, rhs = args[0].replace(" ", "").split("->")
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    for spec, t in zip(lhs.split(","), operands):
        layout, origin = tracker.layouts.get(id(t)), tracker.cuts.origins.get(id(t))
        if layout and origin and len(layout[1]) == 1 and len(spec) == t.dim() and spec[layout[0]] not in rhs:
            tracker.found_wholes.add((*origin, layout[1][0]))


def hold_whole(tracker, out) -> None:
    """Tensors cut to a stretch held whole (``wholes``): whole on every rank, no longer split."""
    for t in tree_flatten(out)[0]:
        origin, layout = tracker.cuts.origins.get(id(t)), tracker.layouts.get(id(t))
        if origin and layout and (*origin, sum(layout[1])) in tracker.wholes:
            tracker.mark(t, None)
            tracker.layouts.pop(id(t))
            tracker.whole_ids.add(id(t))


def whole_flags(wholes, linear: str, start: int, parts) -> list[bool]:
    """Per part of ``linear``'s columns from ``start``: whether it is a stretch held whole."""
    flags = []
    for p in parts:
        flags.append((linear, start, p) in wholes)
        start += p
    return flags


def declare_whole_records(tracker, wholes=frozenset()) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    # stretches of linears' outputs held whole on every rank, (linear, first column, width): found
    # contracted over their split channels by a previous trace (``wholes.record_contraction``), and found now;
    # the tensors cut to one of them, and those computed from such tensors alone
    tracker.wholes: frozenset[tuple[str, int, int]] = frozenset(wholes)
    tracker.found_wholes: set[tuple[str, int, int]] = set()
    tracker.whole_ids: set[int] = set()
