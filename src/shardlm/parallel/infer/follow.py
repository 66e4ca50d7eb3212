"""Which parameters and buffers *follow* split activations: act per channel on them, so split with them.

A column-parallel linear splits its output's channels across TP ranks. A parameter (or a tensor
computed from one alone) whose first dim meets those channels at their full size, along their
split dim (a depthwise convolution with ``groups`` equal to the channels, or an elementwise op
broadcasting it along them), acts on each channel alone: it can be split the same way instead of
keeping the sub-block replicated. Qwen3.5 DeltaNet's conv1d weight, Mamba's ``A_log`` and
``dt_bias``, LFM's short conv. The split activations' channel layout (``layouts.py``) says how each
rank's channels lie; where a stretch of a linear's output is cut again later (Mamba-2's x|B|C), the
parameter's parts are those cuts (``ShardTracker.follow_origins``, ``layouts.Cuts``).
``channels.py`` then splits what follows, as the trace recorded it (``ShardTracker.follows``,
``ShardTracker.buffer_follows``). The trace's violation checks (``checks.py``) ask here first.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from shardlm.parallel.plan.rows import lead_dim

_CATS = {"cat", "concat", "concatenate"}


def follows(
    tracker, name: str, t: torch.Tensor, sharded: list[torch.Tensor], args: tuple, kwargs: dict, out=None
) -> bool:
    """Whether ``t`` (a parameter, or computed from one alone) acts per channel on split
    activations, so that it can be split with them: its first dim meets their split dim at its
    full size (a depthwise convolution over those channels, or an elementwise op broadcasting
    it along them). Their channel layout (``layouts.py``) says how each rank's channels lie;
    without one, the first dim must be the whole width of the one linear they came from."""
    ids = tracker.param_ids(t)
    sources = frozenset().union(*(tracker.sharded[id(s)] for s in sharded))
    if len(ids) != 1:
        return False
    (pid,) = ids
    param = tracker.params.get(pid)
    if param is None or not param.dim() or not t.dim() or tracker.owner(pid) in tracker.legit:
        return False  # a split linear's (or norm's) own parameters: its style places them
    dims = tracker.param_dims.get(id(t))  # a transposed parameter: its dim behind each of t's
    if name in ("conv1d", "conv2d", "convolution"):
        groups = kwargs.get("groups", args[6] if len(args) > 6 else 1)
        x = args[0] if args else kwargs.get("input")
        if x is t or x.dim() < 2 or not _per_group(t, x, groups, tracker.layouts.get(id(x))):
            return False
        met, dim, tdim, spread = [x], 1 - x.dim(), 0, False
    elif name in _CATS:
        dim = _beside(t, sharded, args, kwargs, tracker.layouts)
        if dim is None:
            return False
        met, tdim, spread = sharded, dim, False
    else:
        # elementwise, broadcast: t's dims align with the trailing dims of every split input, its first on
        # their split dim, and the result has their shape (not a product or reduction over the channels)
        if not isinstance(out, torch.Tensor) or not all(
            t.dim() <= s.dim() and (_along(t, s, out) or _spread(t, s, out)) for s in sharded
        ):
            return False
        # both broadcast (Mamba's ``A[None, :, None, :] * dt[:, :, :, None]``): only along a known layout
        spread = not all(_along(t, s, out) for s in sharded)
        # its leading dims of size 1 broadcast (Kimi-Linear's ``A_log`` of shape [1, 1, heads, 1])
        met, tdim = sharded, lead_dim(t)
        dim = tdim - t.dim()
    found = {tracker.layouts.get(id(s)) for s in met}
    layout = found.pop() if len(found) == 1 else None
    origin = None
    per = 1
    pdim = dims[tdim] if dims and dims[tdim] is not None else lead_dim(param)  # the parameter's channel dim
    if name not in _CATS and layout is not None and layout[0] == dim and t.shape[tdim] != param.shape[pdim]:
        per = _per_head(t, tdim, met) if dims is None else _rows_per_index(t, dims, tdim)  # a view into heads
    if (
        layout is not None
        and layout[0] == dim
        and sum(layout[1]) == t.shape[tdim]
        and t.shape[tdim] * per == param.shape[pdim]
    ):
        parts = tuple(p * per for p in layout[1])  # in the parameter's rows
        whole = len(sources) == 1 and parts == (tracker.widths.get(next(iter(sources))),)
        follow = (sources, None if whole else parts)
        origins = {tracker.cuts.origins.get(id(s)) for s in met}
        if not whole and len(origins) == 1 and None not in origins and len(layout[1]) == 1:
            origin = origins.pop()  # its parts: those the linear's cuts make of its columns (``Cuts``)
    elif (
        len(sources) == 1
        and not spread
        and param.shape[0] == tracker.widths.get(next(iter(sources)))
        and (name in ("conv1d", "conv2d", "convolution") or any(a == param.shape[0] for a in t.shape))
    ):
        follow = (sources, None)  # no layout known: the source's whole width
    else:
        return False
    if tracker.follows.get(pid, follow) != follow:
        return False
    tracker.follows[pid] = follow
    if pdim != lead_dim(param):
        tracker.follow_dims[pid] = pdim
    if origin is not None:
        tracker.follow_origins[pid] = origin
    return True


def buffer_follows(tracker, t: torch.Tensor, sharded: list[torch.Tensor], out) -> bool:
    """A buffer of one column-parallel linear's output width multiplied into that whole output
    (Falcon-H1's ``mup_vector``, [1, 1, width]): it follows the linear's rows (``buffer_follows``)."""
    fqn = tracker.buffers.get(id(t))
    if fqn is None or not t.dim() or not isinstance(out, torch.Tensor) or len(sharded) != 1:
        return False  # a scalar buffer (XIELU's beta) multiplies every channel alike
    if out.shape != sharded[0].shape:
        return False
    sources = tracker.sharded[id(sharded[0])]
    (source, *rest) = sorted(sources)
    width = tracker.widths.get(source)
    if rest or tracker.layouts.get(id(sharded[0])) != (-1, (width,)) or t.shape[-1] != width or t.numel() != width:
        return False
    tracker.buffer_follows[fqn] = (sources, None)
    return True


def _per_group(t: torch.Tensor, x: torch.Tensor, groups: int, layout) -> bool:
    """Whether a convolution (its weight or bias ``t``) over ``x`` with ``groups`` acts on each channel alone
    (depthwise: ``groups`` equal to the channels), or on each group of channels alone where every part
    of ``x``'s channel layout is whole groups (Zaya's ``conv_qk_grouped``: one group per head over
    cat(q, k)); ``channels.place_channels`` checks each rank's chunk of every part is whole groups."""
    channels = x.shape[1]
    if not isinstance(groups, int) or groups < 1 or t.shape[0] != channels or channels % groups:
        return False
    if groups == channels:
        return True
    per = channels // groups
    return (
        (t.dim() == 1 or t.shape[1] == per)
        and layout is not None
        and layout[0] == 1 - x.dim()
        and all(p % per == 0 for p in layout[1])
    )


def _beside(t: torch.Tensor, sharded: list[torch.Tensor], args: tuple, kwargs: dict, layouts: dict) -> int | None:
    """The split dim of ``sharded`` where ``t`` is concatenated beside them along another dim, at their
    size there (gpt-oss's per-head ``sinks``, [batch, heads, q, 1], appended to each head's scores
    before the softmax): each head's column meets its own head's scores only. Else None."""
    found = {layouts.get(id(s)) for s in sharded}
    layout = found.pop() if len(found) == 1 else None
    if layout is None:
        return None
    dim = layout[0]
    cat = _arg_dim(args, kwargs, t.dim())
    if cat is None or cat == dim % t.dim() or any(s.dim() != t.dim() or s.shape[dim] != t.shape[dim] for s in sharded):
        return None
    return dim


def _per_head(t: torch.Tensor, tdim: int, met: list[torch.Tensor]) -> int:
    """The rows of the parameter behind ``t`` per index of its split dim, where ``t`` views it as
    [..., heads, *per-head dims] matching the split tensors' per-head dims (Bailing's ``dt_bias`` of
    heads x head_dim, viewed [1, 1, heads, head_dim] and added to each head's gate; Dory's 1-D ``sqk``
    viewed [heads, 1, head_dim]): each head's rows are contiguous, so its split follows the heads. 1 where
    ``t`` broadcasts along all of those dims."""
    trailing = tuple(t.shape[tdim + 1 :])
    if not trailing or not all(_heads_alike(trailing, tuple(s.shape[s.dim() - len(trailing) :])) for s in met):
        return 1
    return math.prod(trailing)


def _rows_per_index(t: torch.Tensor, dims: tuple[int | None, ...], tdim: int) -> int:
    """The rows of a transposed parameter behind ``t`` per index of its split dim ``tdim``: the product of
    ``t``'s later dims viewed out of the same parameter dim (Inkling 2's static taps [kernel, channels],
    transposed and viewed [heads, head_dim, kernel]: head_dim rows per head)."""
    return math.prod(t.shape[d] for d in range(tdim + 1, t.dim()) if dims[d] == dims[tdim])


def _heads_alike(trailing: tuple, per_head: tuple) -> bool:
    """``t``'s per-head dims against a split tensor's: equal, or 1 where it broadcasts (Dory's ``sqk`` viewed
    [heads, 1, head_dim] against q's [heads, seq, head_dim])."""
    return len(trailing) == len(per_head) and all(a in (b, 1) for a, b in zip(trailing, per_head))


def _arg_dim(args: tuple, kwargs: dict, ndim: int) -> int | None:
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return dim % ndim if isinstance(dim, int) and ndim else None


def _along(t: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> bool:
    """``t`` broadcast along the split tensor ``s`` (its dims equal to or 1 against ``s``'s trailing
    ones), giving ``s``'s shape: elementwise, not a product or reduction over the channels."""
    return out.shape == s.shape and all(a == b or a == 1 for a, b in zip(t.shape, s.shape[s.dim() - t.dim() :]))


def _spread(t: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> bool:
    """``t`` and the split tensor ``s`` both broadcast into ``out`` (an outer product per channel:
    Mamba's ``A[None, :, None, :] * dt[:, :, :, None]``, each channel's state row)."""
    try:
        return out.dim() == s.dim() and out.shape == torch.broadcast_shapes(t.shape, s.shape)
    except RuntimeError:
        return False


def declare_follow_records(tracker) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    tracker.buffers: dict[int, str] = {}  # id(buffer) -> its fqn
    tracker.buffer_follows: dict[str, tuple[frozenset[str], None]] = {}  # see ``follow.buffer_follows``
    tracker.params: dict[int, nn.Parameter] = {}  # id -> parameter (``follows``)
    # a parameter acting per channel (or per head) on split activations (a depthwise conv's weight,
    # Mamba's/DeltaNet's A_log, dt_bias): id(param) -> (the column-parallel linears they came from,
    # the parts of their channel layout, or None: the one linear's whole output)
    tracker.follows: dict[int, tuple[frozenset[str], tuple[int, ...] | None]] = {}
    tracker.follow_origins: dict[int, tuple[str, int]] = {}  # id(param) -> origin of the channels it follows
    # a tensor computed from one parameter alone through a transpose (``record_param_dims``) -> the parameter's
    # dim behind each of its dims (None: made of several); and a following parameter -> its dim along the
    # channels where that is not its first dim longer than 1 (Inkling 2's static taps [kernel, channels]: 1)
    tracker.param_dims: dict[int, tuple[int | None, ...]] = {}
    tracker.follow_dims: dict[int, int] = {}


_TRANSPOSED = {"transpose", "swapaxes", "swapdims", "t", "permute"}
_TRANSPOSED_VIEWS = (torch._C.TensorBase.T, torch._C.TensorBase.mT)  # ``p.T`` reaches the mode as their ``__get__``
_VIEWS = {"view", "reshape"}


def record_param_dims(tracker, func, name: str, args: tuple, out) -> None:
    """For a tensor computed from one parameter alone, once it is transposed (``p.T``, ``transpose``,
    ``permute``), the parameter's dim behind each of its dims, through later views, casts and elementwise
    ops (``param_dims``): ``follows`` then splits the parameter along the dim that meets the channels, not its
    first (Inkling 2's ``static_weight.T.view(heads, -1, kernel)``, [kernel, channels] stored)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or len(tracker.param_ids(x)) != 1:
        return
    dims = tracker.param_dims.get(id(x))
    transposed = name in _TRANSPOSED or getattr(func, "__self__", None) in _TRANSPOSED_VIEWS
    if dims is None and not transposed:
        return  # never transposed: its first long dim is its channel dim (``lead_dim``)
    dims = dims or tuple(range(x.dim()))
    if transposed:
        order = _transposed_order(func, name, args, x.dim())
        tracker.param_dims[id(out)] = tuple(dims[d] for d in order)
    elif name in _VIEWS:
        tracker.param_dims[id(out)] = _viewed_dims(dims, tuple(x.shape), tuple(out.shape))
    elif out.shape == x.shape:
        tracker.param_dims[id(out)] = dims  # a cast, elementwise math


def _transposed_order(func, name: str, args: tuple, ndim: int) -> list[int]:
    """The input's dims in the output's order, for a transposing op."""
    order = list(range(ndim))
    if name == "permute":
        given = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        return [d % ndim for d in given]
    if getattr(func, "__self__", None) is torch._C.TensorBase.T:
        return order[::-1]
    a, b = (args[1] % ndim, args[2] % ndim) if name not in ("t",) and len(args) > 2 else (ndim - 2, ndim - 1)
    order[a], order[b] = order[b], order[a]
    return order


def _viewed_dims(dims: tuple[int | None, ...], shape: tuple[int, ...], new: tuple[int, ...]) -> tuple:
    """A view's dims, each the parameter dim of the input dim it is cut from (its stretch of the flat
    elements inside that dim's), None where it spans several input dims or is of size 1."""
    new = tuple(math.prod(shape) // -math.prod(new) if n == -1 else n for n in new)
    inner = [math.prod(shape[d + 1 :]) for d in range(len(shape))]  # elements per index of each input dim
    out: list[int | None] = []
    for k, n in enumerate(new):
        lo = math.prod(new[k + 1 :])
        within = [d for d in range(len(shape)) if shape[d] > 1 and inner[d] <= lo and lo * n <= inner[d] * shape[d]]
        out.append(dims[within[0]] if n > 1 and within else None)
    return tuple(out)
