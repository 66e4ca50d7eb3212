"""Whole tensors broadcast over split activations: parameters whose gradients are summed over TP.

DiffLlama scales the second half of its heads by one learned scalar, ``lambda_full = exp(sum(lambda_q1 *
lambda_k1)) - exp(sum(lambda_q2 * lambda_k2)) + lambda_init``, computed from its parameters alone. With the
heads split, every rank computes that scalar whole and applies it to its own heads: the forward is
exact, and each rank's gradient of the lambdas is the sum over its heads only, so the sum of the
ranks' gradients over TP is the one-process gradient. Such a parameter stays replicated (its module
``replicate_own``) and is listed in ``Plan.partial_grads`` (``runtime/grads.py`` sums it).

Found by the trace: a tensor computed from parameters alone (or a parameter) meeting split activations in
an elementwise op where it is broadcast over their split dim (one element, or size 1 / absent there).
Not so where the same parameter also meets whole activations (its gradient from those would be
counted tp times): then it is a violation as before (``checks.check``).
"""

from __future__ import annotations

import torch

# elementwise ops with a broadcast operand: each split position uses the one whole value
ELEMENTWISE = {
    "mul", "__mul__", "__rmul__", "mul_", "__imul__", "add", "__add__", "__radd__", "add_", "__iadd__",
    "sub", "__sub__", "__rsub__", "sub_", "__isub__", "div", "__truediv__", "__rtruediv__", "div_",
}  # fmt: skip
_MATMULS = {"matmul", "__matmul__"}


def declare_broadcast_records(tracker) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    # id(parameter) -> (the sources of the split activations it met broadcast, its owner)
    tracker.broadcast: dict[int, tuple[frozenset[str], str]] = {}
    tracker.whole_uses: set[int] = set()  # ids of parameters met by whole (unsplit) activations


def broadcast_over_split(
    tracker, name: str, t: torch.Tensor, sharded: list[torch.Tensor], sources, args: tuple = ()
) -> bool:
    """Whether ``t`` (a parameter, or computed from parameters alone) meets the split ``sharded`` in
    elementwise op ``name`` broadcast over their split dim, or multiplies them within each head
    (``_within_heads``, ``args`` the op's); recorded if so."""
    if tracker.owners(t) & tracker.legit.keys():
        return False  # a split module's own parameters are placed by its style
    if name in _MATMULS:
        return len(args) == 2 and args[1] is t and _within_heads(tracker, t, sharded, sources)
    if name not in ELEMENTWISE:
        return False
    for s in sharded:
        layout = tracker.layouts.get(id(s))
        if t.numel() == 1:
            continue
        if layout is None or -layout[0] <= t.dim() and t.shape[layout[0]] != 1:
            return False
    owner = sorted(tracker.owners(t))[0]
    for pid in tracker.param_ids(t):
        tracker.broadcast.setdefault(pid, (frozenset(sources), owner))
    return True


def _within_heads(tracker, t: torch.Tensor, sharded: list[torch.Tensor], sources) -> bool:
    """``split @ t`` with ``t`` 2-D, the split activations cut along a dim before their last (their heads):
    the same matrix multiplies each head's features (Inkling 2's bank of relative-logit profiles,
    [d_rel, extent]), so it is whole on every rank and its gradient summed over TP; recorded if so."""
    if t.dim() != 2 or len(sharded) != 1 or tracker.sharded.get(id(t)) or t is sharded[0]:
        return False
    s = sharded[0]
    layout = tracker.layouts.get(id(s))
    if layout is None or s.dim() < 3 or layout[0] % s.dim() >= s.dim() - 1 or s.shape[-1] != t.shape[0]:
        return False
    owner = sorted(tracker.owners(t))[0]
    for pid in tracker.param_ids(t):
        tracker.broadcast.setdefault(pid, (frozenset(sources), owner))
    return True


def record_whole_use(tracker, inputs: list[torch.Tensor]) -> None:
    """An op with no split input: the parameters any of its inputs is (computed from) meet whole
    activations there, unless every input is (from) parameters."""
    if all(tracker.owners(t) for t in inputs):
        return
    for t in inputs:
        tracker.whole_uses |= tracker.param_ids(t)


def broadcast_violations(tracker, names: dict[int, str]) -> list[str]:
    """The parameter FQNs (``names``: id -> fqn) whose gradients are summed over TP; a parameter met by
    whole activations too is a violation instead (appended to ``tracker.violations``)."""
    why = "a parameter of {} meets both its split and whole activations (broadcast)"
    return summed_or_violations(tracker, tracker.broadcast, tracker.whole_uses, names, why)


def summed_or_violations(tracker, met: dict, whole: set, names: dict[int, str], why: str) -> list[str]:
    """Of the parameters ``met`` by split activations (id -> (sources, owner)), the FQNs whose gradients are
    summed over TP; those in ``whole`` (met by whole activations too) are violations instead, ``why``
    formatted with the owner (``broadcast_violations``, ``head_inputs.partial_grads``)."""
    partial = []
    for pid, (sources, owner) in met.items():
        if pid in whole:
            tracker.violations.append((sources, why.format(owner)))
        else:
            partial.append(names[pid])
    return sorted(partial)
