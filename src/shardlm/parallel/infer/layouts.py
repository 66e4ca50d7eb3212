"""Channel layouts of split tensors in the trace: which dim of a tensor is split across TP ranks, and
in what equal-split parts.

A column-parallel linear's output is split along its last dim, one part of its whole width (each
rank holds its chunk). Mixers then reshape it: a short convolution's ``in_proj`` output is
transposed and chunked into B, C, x; Qwen3-Next's fused ``in_proj_qkvz`` is viewed into key-head
groups, split inside each group and flattened back; OLMo-hybrid concatenates three projections'
outputs; and a depthwise ``conv1d`` (or a per-head ``A_log``) then meets the result along its
channel dim. Each rank holds its chunk of every *part* of that dim (a part: a stretch of channels
split evenly over the ranks), so a parameter meeting it there is split the same way: one part,
``Shard(0)``; equal parts, ``_StridedShard``; unequal ones (q, k, v of different widths), stored
whole with each rank using its rows (``channels.py``).

``propagate`` follows a layout through the ops a mixer applies between its projections and the
parameters: transposes, cuts and concatenations along the split dim or beside it, views that
split the split dim into heads or merge heads back, permutations, einsums (by subscript),
indexing that adds dims of size 1 around it (Mamba's ``A[None, :, None, :]``, ``dt[:, :, :, None]``),
and any op that keeps the rank and the split dim's size (elementwise math, activations, casts,
slicing of other dims; judged by size, so the ops that move dims are followed by position first).
Anything else
drops the layout; a parameter meeting a tensor without one is then judged by its source's whole
width only (``follow.follows``).

A layout is ``(dim, parts)``: ``dim`` counted from the end (negative, so broadcasting keeps it),
``parts`` in elements of that dim.

A tensor that is one contiguous stretch of one linear's output columns, not regrouped on the way
(transposed, convolved per channel, cut), also has an *origin* ``(linear, first column)``. A cut
of such a tensor along its split dim is then a cut of the linear's output at known columns
(``Cuts``): Mamba-2's ``in_proj`` is cut into [z, xBC, dt] and, after the convolution, xBC into
[x, B, C], so its parts are [z, x, B, C, dt] and the conv over xBC follows [x, B, C]. Two cuts
found at two places of the dataflow make one set of parts; no name is read.
"""

from __future__ import annotations

import math

import torch

Layout = tuple[int, tuple[int, ...]]


Origin = tuple[str, int]  # (column-parallel linear, the first of its output columns a tensor holds)


_TRANSPOSE = {"transpose", "swapaxes", "swapdims", "transpose_"}


_CUTS = {"split", "chunk", "split_with_sizes", "tensor_split"}


_RESHAPES = {"view", "reshape", "unflatten", "flatten", "view_as", "reshape_as"}


_CATS = {"cat", "concat", "concatenate"}


def split_last(layouts: dict[int, Layout], t: torch.Tensor) -> bool:
    """Whether split ``t`` may be a flat column-parallel output: its layout, where known, splits its last dim
    (not viewed into heads along an earlier one, whatever its last dim's size: Inkling 2's head_dim 16 against
    its conv taps' projection of 16 outputs)."""
    layout = layouts.get(id(t))
    return layout is None or not t.dim() or layout[0] % t.dim() == t.dim() - 1


_REDUCED = {"sum", "mean", "logsumexp", "amax", "amin", "prod", "norm"}  # over ``dim``, not kept: one dim fewer


_INDEX = {"__getitem__", "unsqueeze"}  # new dims of size 1 (``A[None, :, None, :]``), other dims sliced


def _neg(dim: int, ndim: int) -> int:
    return dim - ndim if dim >= 0 else dim


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default=None):
    return args[pos] if len(args) > pos else kwargs.get(name, default)


class Cuts:
    """Origins of tensors (see the module docstring) and the columns at which each linear's output
    was cut: ``parts(linear)`` are the part sizes all its cuts make together."""

    def __init__(self) -> None:
        self.origins: dict[int, Origin] = {}
        self.bounds: dict[str, set[int]] = {}
        # id(tensor) -> the linears' whole outputs it concatenates along the split dim, in order (``_cat``);
        # and those viewed into heads of so many channels that a head spans parts (``joined_heads``)
        self.joined: dict[int, tuple[tuple[str, int], ...]] = {}
        self.head_views: set[tuple[tuple[tuple[str, int], ...], int]] = set()

    def parts(self, linear: str, start: int, width: int) -> tuple[int, ...]:
        """The parts of ``linear``'s columns ``start`` to ``start + width`` that its cuts make."""
        inner = sorted(b for b in self.bounds.get(linear, ()) if start < b < start + width)
        edges = [start, *inner, start + width]
        return tuple(b - a for a, b in zip(edges, edges[1:]))

    def record(self, t: torch.Tensor, out, widths: list[int]) -> None:
        origin = self.origins.get(id(t))
        if origin is None:
            return
        linear, offset = origin
        self.bounds.setdefault(linear, set()).add(offset)
        for piece, width in zip(out, widths):
            self.origins[id(piece)] = (linear, offset)
            offset += width
            self.bounds[linear].add(offset)


def propagate(name: str, args: tuple, kwargs: dict, out, layouts: dict[int, Layout], cuts: Cuts | None = None) -> None:
    """Set ``layouts`` for the tensor(s) ``out`` of op ``name`` from its inputs' layouts (and
    ``cuts``: their origins, and the columns a cut of one cuts its linear's output at)."""
    cuts = cuts if cuts is not None else Cuts()
    if name in _CATS:
        _cat(args, kwargs, out, layouts, cuts)
        return
    if name == "einsum":
        _einsum(args, out, layouts, cuts)
        return
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is not None and id(first) in layouts:
        dim, parts = layouts[id(first)]
        origin = cuts.origins.get(id(first))
        if name in _TRANSPOSE and isinstance(out, torch.Tensor):
            a, b = (_neg(d, first.dim()) for d in (_arg(args, kwargs, 1, "dim0"), _arg(args, kwargs, 2, "dim1")))
            layouts[id(out)] = (b if dim == a else a if dim == b else dim, parts)
            _keep_origin(cuts, origin, out)
            return
        if name in _CUTS and isinstance(out, (tuple, list)):
            _cut(name, first, args, kwargs, out, (dim, parts), layouts, cuts)
            return
        if name == "permute" and isinstance(out, torch.Tensor):
            order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            order = [d % first.dim() for d in kwargs.get("dims", order)]
            if len(order) == first.dim():  # the split dim goes where the permutation puts it
                layouts[id(out)] = (order.index(first.dim() + dim) - first.dim(), parts)
                _keep_origin(cuts, origin, out)
            return
        if name in _INDEX and isinstance(out, torch.Tensor):
            found = _indexed(name, first, args, dim)
            if found is not None and out.shape[found] == first.shape[dim]:
                layouts[id(out)] = (found, parts)
                _keep_origin(cuts, origin, out)
                return
        if name in _REDUCED and isinstance(out, torch.Tensor) and out.dim() == first.dim() - 1:
            reduced = _arg(args, kwargs, 1, "dim")
            if isinstance(reduced, int) and _neg(reduced, first.dim()) > dim:
                layouts[id(out)] = (dim + 1, parts)  # a dim after the split one reduced away (Granite-SWA's lse)
            return
        if name in _RESHAPES and isinstance(out, torch.Tensor):
            found = _reshaped(tuple(first.shape), tuple(out.shape), dim, parts)
            if found is not None:
                layouts[id(out)] = found
                _keep_origin(cuts, origin if found[1] == parts else None, out)  # regrouped: no columns
                if id(first) in cuts.joined and found[1] != parts and found[1][0]:
                    cuts.head_views.add((cuts.joined[id(first)], parts[0] // found[1][0]))
            return
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor):
            found = _kept(args, kwargs, t, layouts)
            if found is not None:
                layouts[id(t)] = found
                origins = {cuts.origins.get(id(a)) for a in (*args, *kwargs.values()) if id(a) in layouts}
                _keep_origin(cuts, origins.pop() if len(origins) == 1 else None, t)


def _keep_origin(cuts: Cuts, origin: Origin | None, out: torch.Tensor) -> None:
    if origin is not None:
        cuts.origins[id(out)] = origin


def _einsum(args: tuple, out, layouts: dict[int, Layout], cuts: Cuts) -> None:
    """An einsum's output keeps the split dim under its operands' split subscript (Mamba-2's per-head
    chunk states), wherever the output spec puts it; summed over (B and C over their state dim: the
    ``wholes.record_contraction``), it has none. By subscript, not by size: a head count equal to
    a state or chunk size must not pass for it."""
    if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], str) or "->" not in args[0]:
        return
    lhs, rhs = args[0].replace(" ", "").split("->")
    if "." in lhs:
        return
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    found, origins = set(), set()
    for spec, t in zip(lhs.split(","), operands):
        if isinstance(t, torch.Tensor) and id(t) in layouts and len(spec) == t.dim():
            dim, parts = layouts[id(t)]
            if spec[dim] not in rhs:
                return
            found.add((rhs.index(spec[dim]) - len(rhs), parts))
            origins.add(cuts.origins.get(id(t)))
    if len(found) == 1:
        layouts[id(out)] = found.pop()
        _keep_origin(cuts, origins.pop() if len(origins) == 1 else None, out)


def _kept(args: tuple, kwargs: dict, out: torch.Tensor, layouts: dict[int, Layout]) -> Layout | None:
    """The layout an op keeps: that of its split inputs whose split dim lies in ``out`` at the same
    size (broadcast elementwise math, activations, slicing other dims), if they agree."""
    found = set()
    for t in (*args, *kwargs.values()):
        if isinstance(t, torch.Tensor) and id(t) in layouts:
            dim, parts = layouts[id(t)]
            if -dim > out.dim() or out.shape[dim] != t.shape[dim]:
                return None
            found.add((dim, parts))
    return found.pop() if len(found) == 1 else None


def _cut(name, t, args, kwargs, out, layout: Layout, layouts: dict[int, Layout], cuts: Cuts) -> None:
    dim, parts = layout
    cut = _neg(_arg(args, kwargs, 2, "dim", 0), t.dim())
    if cut != dim:
        for piece in out:
            layouts[id(piece)] = layout
            _keep_origin(cuts, cuts.origins.get(id(t)), piece)
        return
    if len(parts) == 1:
        cuts.record(t, out, [piece.shape[dim] for piece in out])
    bounds, offset = [0], 0
    for p in parts:
        offset += p
        bounds.append(offset)
    start = 0
    for piece in out:
        stop = start + piece.shape[dim]
        inner = [b for b in bounds if start < b < stop]
        if start in bounds and stop in bounds:  # whole parts
            layouts[id(piece)] = (dim, tuple(b - a for a, b in zip([start, *inner], [*inner, stop])))
        elif len(parts) == 1:  # a cut of one part: it becomes a packed part of its own (``later_parts``)
            layouts[id(piece)] = (dim, (stop - start,))
        start = stop


def _indexed(name: str, t: torch.Tensor, args: tuple, dim: int) -> int | None:
    """The split dim ``dim`` of ``t`` in ``t.unsqueeze(d)`` or ``t[index]`` (counted from the end), where
    the index adds dims (None), slices or picks other dims, and takes the split dim whole; else None."""
    ndim, pos = t.dim(), t.dim() + dim
    if name == "unsqueeze":
        d = args[1] if len(args) > 1 else None
        if not isinstance(d, int):
            return None
        d = d % (ndim + 1)
        return dim - 1 if d > pos else dim
    index = args[1] if len(args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    if any(i is not None and i is not Ellipsis and not isinstance(i, (int, slice)) for i in index):
        return None  # advanced (tensor) indexing
    if sum(i is Ellipsis for i in index) > 1:
        return None
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    items = []  # per item: the input dims it takes (0 or 1), or the run of an Ellipsis
    for i in index:
        items.append((i, ndim - consumed if i is Ellipsis else 0 if i is None else 1))
    src, dst, found = 0, 0, None
    for i, n in items:
        if i is Ellipsis:
            if src <= pos < src + n:
                found = dst + pos - src
            src, dst = src + n, dst + n
        elif i is None:
            dst += 1
        elif src == pos:
            if not (isinstance(i, slice) and i == slice(None)):
                return None  # the split dim cut or picked
            found, src, dst = dst, src + 1, dst + 1
        else:
            src, dst = src + 1, dst + (0 if isinstance(i, int) else 1)
    if found is None:
        found = dst + pos - src  # after the index: untouched trailing dims
    out_ndim = dst + ndim - src
    return found - out_ndim


def _reshaped(old: tuple[int, ...], new: tuple[int, ...], dim: int, parts: tuple[int, ...]) -> Layout | None:
    """The split dim of ``old`` (``dim``) in ``new``: the dim whose trailing block holds the same
    elements (dims outer than the split one untouched), parts rescaled to its elements; None where
    the split dim is merged with an outer dim or cut finer than a part."""
    inner = math.prod(old[len(old) + dim + 1 :])
    block = old[dim] * inner
    for j in range(len(new) - 1, -1, -1):
        if math.prod(new[j:]) == block:
            unit = math.prod(new[j + 1 :])
            if all((p * inner) % unit == 0 for p in parts):
                return (j - len(new), tuple(p * inner // unit for p in parts))
            return None
        if math.prod(new[j:]) > block:
            return None
    return None


def _cat(args: tuple, kwargs: dict, out, layouts: dict[int, Layout], cuts: Cuts) -> None:
    """Along the split dim: the parts of each (and, where each is one linear's whole output, which:
    ``Cuts.joined``); beside it: the one layout of the split tensors, and a tensor without one
    concatenated at their size there (gpt-oss's per-head ``sinks`` appended to the scores) takes it
    too (``follow.follows`` judges that tensor)."""
    tensors = _arg(args, kwargs, 0, "tensors", ())
    if not isinstance(out, torch.Tensor) or not tensors:
        return
    split = [t for t in tensors if id(t) in layouts]
    dims = {layouts[id(t)][0] for t in split}
    if len(dims) != 1:
        return
    (dim,) = dims
    if _neg(_arg(args, kwargs, 1, "dim", 0), out.dim()) == dim:
        if len(split) == len(tensors):
            layouts[id(out)] = (dim, tuple(p for t in tensors for p in layouts[id(t)][1]))
            origins = [cuts.origins.get(id(t)) for t in tensors]
            if len(tensors) > 1 and all(o is not None and o[1] == 0 for o in origins):
                cuts.joined[id(out)] = tuple((o[0], t.shape[dim]) for o, t in zip(origins, tensors))
    elif len({layouts[id(t)] for t in split}) == 1 and all(
        t.dim() == out.dim() and t.shape[dim] == out.shape[dim] for t in tensors
    ):
        layouts[id(out)] = layouts[id(split[0])]
        origins = {cuts.origins.get(id(t)) for t in tensors}
        if len(origins) == 1 and None not in origins:  # the same columns, more rows (Zaya's delayed value)
            _keep_origin(cuts, origins.pop(), out)


def declare_layout_records(tracker) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    tracker.layouts: dict[int, Layout] = {}  # id(split tensor) -> its channel layout (``layouts.py``)
    tracker.cuts = Cuts()  # origins of split tensors in their linear's columns, and where those were cut
