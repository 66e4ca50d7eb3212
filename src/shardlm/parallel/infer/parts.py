"""Packed projections: where a column-parallel linear's output is cut into parts along its width.

The first op that consumes a colwise output tells whether the projection is fused: a split, chunk
or slice of the last dim means packed parts (GPT-2 ``c_attn``, Phi-3 ``qkv_proj`` and
``gate_up_proj``), each part then split across ranks on its own (``packed_colwise``); a view into
heads means per-head interleaving (GPT-NeoX), which plain column sharding already keeps whole. A
fused projection whose output is cut only later, after per-channel ops (DeltaNet's q/k/v, convolved
first), is found packed at that cut (``ShardTracker.later_parts``); a cut of a stretch of a linear's
output (Mamba-2's x|B|C, cut again after its conv) refines that linear's parts (``layouts.Cuts``,
``refined``). A cut into equal pieces along the split heads of a tensor computed from several linears
(DiffLlama's attention output, from q, k and v, chunked into the two halves of its heads, which it
pairs) packs each of them in as many equal parts (``record_heads_cut``): each rank then holds its
chunk of both halves, so the pairs stay on one rank.
"""

from __future__ import annotations

import torch

# torch ops by which a consumer cuts a fused projection's output into parts along the last dim
SPLIT_OPS = {"split", "chunk", "split_with_sizes", "tensor_split", "unbind"}


def record_slice(tracker, tensor: torch.Tensor, index) -> None:
    """The int bounds of a slice ``tensor[..., a:b]`` of the last dim (``parts_from_consumer``), or of
    ``heads[..., a:b, :]`` / ``heads[..., [i], :]`` of a view of it into heads (``record_head_view``:
    Falcon's multi-query ``view(.., num_heads + 2, head_dim)`` cut into queries, key and value), in
    its columns."""
    index = index if isinstance(index, tuple) else (index,)
    if index and index[0] is Ellipsis and len(index) == 2 and isinstance(index[1], slice):
        bounds = tracker.slices.setdefault(id(tensor), set())
        for b in (index[1].start, index[1].stop):
            if isinstance(b, int):
                bounds.add(b)
    elif id(tensor) in tracker.head_views and len(index) == 3 and index[0] is Ellipsis and index[2] == slice(None):
        source, n, d = tracker.head_views[id(tensor)]
        picked = index[1]
        if isinstance(picked, list) and len(picked) == 1 and isinstance(picked[0], int):
            picked = slice(picked[0] % n, picked[0] % n + 1)
        if isinstance(picked, slice) and picked.step is None:
            bounds = tracker.slices.setdefault(id(source), set())
            for b in (picked.start, picked.stop):
                if isinstance(b, int):
                    bounds.add((b % n if b < 0 else b) * d)


def record_head_view(tracker, t: torch.Tensor, out: torch.Tensor) -> None:
    """``out``, the last dim of ``t`` viewed into [heads, head_dim] (``record_slice``)."""
    if t.dim() and out.dim() == t.dim() + 1 and out.shape[:-2] == t.shape[:-1]:
        tracker.head_views[id(out)] = (t, out.shape[-2], out.shape[-1])


def record_later_split(tracker, name: str, source: str, args: tuple, kwargs: dict) -> None:
    """A split of a tensor computed from ``source``'s output alone, along a dim of its full width."""
    t, width = args[0], tracker.widths.get(source)
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    if not isinstance(dim, int) or not t.dim() or t.shape[dim] != width or source in tracker.later_parts:
        return
    sizes = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("sections"))
    if name == "chunk" and isinstance(sizes, int) and sizes > 1 and width % sizes == 0:
        sizes = width // sizes  # chunk's argument is the number of parts
    if isinstance(sizes, (list, tuple)) and sum(sizes) == width and len(sizes) > 1:
        tracker.later_parts[source] = list(sizes)
    elif isinstance(sizes, int) and 0 < sizes < width and width % sizes == 0:
        tracker.later_parts[source] = [sizes] * (width // sizes)


def record_heads_cut(tracker, name: str, sources: frozenset[str], args: tuple, kwargs: dict, out) -> None:
    """A chunk/split into n >= 2 equal pieces, along its split dim, of a tensor computed from several
    column-parallel linears (``tracker.layouts`` says which dim is split): each is packed in n equal
    parts (``later_parts``), where its width allows and no other cut decided its parts."""
    t = args[0]
    layout = tracker.layouts.get(id(t))
    if len(sources) < 2 or layout is None or len(layout[1]) != 1 or not isinstance(out, (tuple, list)):
        return
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    if not isinstance(dim, int) or dim % t.dim() != layout[0] % t.dim():
        return
    sizes = {piece.shape[dim] for piece in out}
    if len(out) < 2 or len(sizes) != 1:
        return
    for source in sources:
        width = tracker.widths.get(source)
        if width and width % len(out) == 0 and source not in tracker.later_parts:
            tracker.later_parts[source] = [width // len(out)] * len(out)


def parts_from_consumer(tracker, out: torch.Tensor) -> list[int] | None:
    """Part sizes if the projection output is cut along its last dim right away, else None."""
    width = out.shape[-1]
    if id(out) in tracker.slices:
        bounds = sorted({0, width} | {b % width if b < 0 else b for b in tracker.slices[id(out)]})
        return [b - a for a, b in zip(bounds, bounds[1:])]
    name, rest = tracker.first_consumer.get(id(out), ("", ()))
    if name not in SPLIT_OPS or not rest:
        return None
    dim = rest[1] if len(rest) > 1 else -1
    if dim not in (-1, out.dim() - 1):
        return None
    arg = rest[0]
    if name == "chunk":
        return [width // arg] * arg
    if isinstance(arg, int):
        return [arg] * (width // arg)
    return list(arg)


def refined(parts: list[int], cut: tuple[int, ...]) -> list[int]:
    """The parts both ``parts`` and ``cut`` (of the same width) make: every boundary of either."""
    bounds = {0}
    for sizes in (parts, cut):
        offset = 0
        for p in sizes:
            offset += p
            bounds.add(offset)
    edges = sorted(bounds)
    return [b - a for a, b in zip(edges, edges[1:])]


def declare_parts_records(tracker) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    tracker.first_consumer: dict[int, tuple[str, tuple]] = {}
    tracker.slices: dict[int, set[int]] = {}
    tracker.head_views: dict[int, tuple[torch.Tensor, int, int]] = {}  # id(view) -> (its input, heads, head dim)
    # column-parallel linear -> part sizes, where a tensor computed from its output alone is cut
    # along its width later on (Qwen3.5's qkv: transposed, convolved, transposed back, then split)
    tracker.later_parts: dict[str, list[int]] = {}
