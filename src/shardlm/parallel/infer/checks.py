"""What cannot act on split activations as they stand: the violations that keep a sub-block replicated.

Every op of the trace that reads a split tensor is checked (``check``): a parameter of a module not
split with it, a tensor computed from such parameters, or a per-head tensor not split with the heads
(ALiBi slopes) would compute with each rank's share as if it were the whole, unless it follows the
channels (``follow.py``). A reduction over the split width of a flat column-parallel output (a
parameter-free norm, a softmax gate) would reduce each rank's columns only (``check_reduction``).
A split tensor sliced to nothing at the trace's length (DeepSeek-V4's heavily compressed attention keeps only
whole windows of 128 tokens: none of the trace's 13) is a path the trace never follows (``check_emptied``).
Each violation names the column-parallel linears the tensor came from: ``trace_model``'s caller keeps
that whole sub-block replicated (``autotp``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlm.parallel.infer.broadcast import ELEMENTWISE, broadcast_over_split
from shardlm.parallel.infer.follow import buffer_follows, follows
from shardlm.parallel.infer.head_einsums import heads_aligned
from shardlm.parallel.infer.head_inputs import meets_split
from shardlm.parallel.infer.layouts import split_last
from shardlm.parallel.infer.narrowed import candidate

# ops that reduce along a dim: over the split width of a flat column-parallel output, each rank
# would reduce its own columns only (a parameter-free norm, a softmax gate)
_REDUCTIONS = {
    "sum", "mean", "softmax", "log_softmax", "norm", "var", "std", "var_mean", "std_mean", "amax", "amin",
    "max", "min", "argmax", "argmin", "topk", "sort", "argsort", "cumsum", "cumprod", "logsumexp", "prod",
    "layer_norm", "rms_norm", "group_norm", "normalize", "vector_norm", "linalg_vector_norm",
}  # fmt: skip


def check(
    tracker, name: str, inputs: list[torch.Tensor], sources: frozenset[str], args=(), kwargs=None, out=None
) -> None:
    """Record what cannot act on this op's sharded input(s) as they stand."""
    sharded = [t for t in inputs if id(t) in tracker.sharded]
    for t in inputs:
        if id(t) in tracker.sharded:
            continue
        if follows(tracker, name, t, sharded, args, kwargs or {}, out) or buffer_follows(tracker, t, sharded, out):
            continue
        if heads_aligned(tracker, t, sharded):
            continue  # a per-head parameter at the split heads (XLNet's ``r_w_bias``: ``head_einsums.py``)
        if (isinstance(t, nn.Parameter) or id(t) in tracker.from_params) and broadcast_over_split(
            tracker, name, t, sharded, sources, args
        ):
            continue  # one whole value for every split position: its gradient summed over TP (``broadcast.py``)
        if isinstance(t, nn.Parameter):
            owner = tracker.owner(id(t))
            if owner not in tracker.legit:
                tracker.violations.append((sources, f"a parameter of {owner} acts on its split activations ({name})"))
        elif id(t) in tracker.from_params and not tracker.from_params[id(t)] <= tracker.legit.keys():
            owner = sorted(tracker.from_params[id(t)] - tracker.legit.keys())[0]
            tracker.violations.append(
                (sources, f"a tensor computed from parameters of {owner} acts on its split activations ({name})")
            )
        elif whole_beside(tracker, name, t, sharded, sources):
            where = tracker.running[-1] if tracker.running else "the model"
            why = f"{where} adds its output to a whole activation of its width ({name}), no row-parallel linear between"
            tracker.violations.append((sources, why))
            for fqn in sources:
                tracker.misfits.setdefault(fqn, why)
        elif t.dim() and t.numel() > 1 and tracker.heads and id(t) not in tracker.from_split_shape | tracker.whole_ids:
            if meets_split(tracker, t, sources):
                continue  # handed to this module per head (BLOOM's ALiBi): each rank its heads' rows
            for s in sharded:
                # the heads dim of split activations is never the last (that is head_dim or keys)
                for i in range(2, min(t.dim(), s.dim()) + 1):
                    if t.shape[-i] == s.shape[-i] and t.shape[-i] in tracker.heads:
                        candidate(tracker, t)  # made from a row-parallel output: narrowed? (Doge's mask)
                        tracker.violations.append(
                            (
                                sources,
                                f"a per-head tensor of shape {tuple(t.shape)} (ALiBi slopes, position "
                                f"biases) is not split with the heads ({name})",
                            )
                        )
                        return


def whole_beside(tracker, name: str, t: torch.Tensor, sharded: list, sources: frozenset[str]) -> bool:
    """Whether activation ``t``, whole on every rank (no parameter, no row-parallel output's region, no
    latent, nothing held whole), meets a flat column-parallel output of its own shape elementwise: at one
    rank's shapes they differ, whatever comes after. Zamba2's hybrid layer adds its ``linear`` (hidden ->
    hidden, reading the shared block's whole output) to the residual stream: that linear, split, makes the
    trace pair the mixer after it the wrong way round (``autotp._region`` keeps it whole alone first)."""
    if name not in ELEMENTWISE or not t.requires_grad or not t.dim():
        return False
    if id(t) in tracker.rows or id(t) in tracker.latent or id(t) in tracker.whole_ids:
        return False
    widths = {tracker.widths.get(src) for src in sources}
    return t.shape[-1] in widths and t.shape[-1] > 1 and any(s.shape == t.shape for s in sharded)


def check_reduction(tracker, name: str, args: tuple, kwargs: dict, sources: frozenset[str]) -> None:
    """A reduction over the last dim of a flat column-parallel output (its width not yet viewed
    into heads) would reduce each rank's columns only."""
    if (
        name not in _REDUCTIONS
        or not args
        or not isinstance(args[0], torch.Tensor)
        or id(args[0]) not in tracker.sharded
    ):
        return
    t = args[0]
    layout = tracker.layouts.get(id(t)) if tracker.deferred else None  # inside a deferred module: any split dim
    widths = {tracker.widths.get(src) for src in sources}
    full = bool(t.dim()) and split_last(tracker.layouts, t) and t.shape[-1] in widths
    if not t.dim() or not (full or layout):
        return
    if name in ("layer_norm", "rms_norm", "group_norm"):
        dims = {t.dim() - 1}
    else:
        pos = 2 if name == "topk" else 1
        dim = kwargs.get("dim", args[pos] if len(args) > pos else None)
        if isinstance(dim, torch.Tensor) or (
            name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor)
        ):
            return  # elementwise max/min of two tensors
        if dim is None and name in ("softmax", "log_softmax", "sort", "argsort", "topk", "normalize", "cumsum"):
            dim = -1
        dims = None if dim is None else {d % t.dim() for d in (dim if isinstance(dim, (tuple, list)) else [dim])}
    if dims is None or t.dim() - 1 in dims if full else layout[0] % t.dim() in dims:
        tracker.violations.append((sources, f"{name} over the split width {t.shape[-1]}"))


def check_emptied(tracker, name: str, args: tuple, out, sources: frozenset[str]) -> None:
    """A split tensor whose positions are sliced to none at the trace's sequence length: what the forward
    computes from them at a longer one (DeepSeek-V4's compressors keep ``seq // rate * rate`` positions,
    windows of 128 for heavily compressed attention: none of the trace's) is never traced, so its sources are
    kept whole rather than split unseen (at 128 tokens a split ``gate_proj`` would meet the whole
    ``position_bias [128, head_dim]``). An empty slice of another dim (CodeGen's ``x[..., rotary_dim:]``, its
    rotary dims all of head_dim) hides nothing."""
    if name != "__getitem__" or not isinstance(out, torch.Tensor) or out.numel() or not args[0].numel():
        return
    if tracker.seq in args[0].shape and tracker.seq not in out.shape:
        tracker.violations.append(
            (sources, "its positions are sliced to none at the trace's length (a window longer than it), not followed")
        )
