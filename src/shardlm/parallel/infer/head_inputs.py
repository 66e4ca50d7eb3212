"""Per-head tensors a module is handed, built outside it from the config's head count: each rank's heads.

BLOOM builds its ALiBi bias once per forward, in the model, from ``num_heads`` (``build_alibi_tensor``:
``[batch * heads, 1, keys]``) and hands it to every attention module, which adds it to its scores;
MPT its ``position_bias`` (``[heads, 1, keys]``), sliced inside the attention first. Split by heads, a
rank's scores hold its own heads only, so it needs those heads' rows of the bias: not the first
``heads / tp`` slopes, but its own, at their global head index. The trace records a tensor entering
a module's forward (positional or keyword) with a dim of a head count (``record_inputs``), follows it
through ops of its own (``follow``), and, where it meets the split scores inside that module's own
code (``meets_split``), the module's input is planned ``Plan.head_inputs`` instead of a violation.
``plan/head_inputs.py`` slices it per rank as the module is called.

Such a tensor may carry gradients, where it is computed from parameters and no activation (CPM-Ant's
position bias, looked up in its ``relative_attention_bias`` table of ``[buckets, heads]`` once per forward
and handed to every block): each rank's gradient of those parameters then comes from its own heads
only, and the sum over TP is the one-process gradient (``Plan.partial_grads``, as for DiffLlama's
lambdas: ``broadcast.py``); where the same tensor also meets whole activations (a block kept whole) it is
a violation instead. Computed from no activation means no parameter of the input embedding behind it (every
activation starts there); one that is cannot be sliced per rank (the activations' gradients would be
partial) and stays a violation.
"""

from __future__ import annotations

import torch

from shardlm.parallel.infer.broadcast import summed_or_violations

BUFFER = "self."  # the key of a module's own buffer among its per-head inputs (no argument is named so)


def record_inputs(tracker, name: str, args: tuple, kwargs: dict, module=None) -> None:
    """Tensors handed to module ``name`` that are whole and have a head count as a dim other than the
    last: candidates (``head_inputs``: id -> (module, argument, that dim)); so are the module's own buffers
    of that kind (MiniMax's ALiBi-like ``slope_rate`` and decays, built in its ``__init__`` from the config's
    head count), keyed ``self.<buffer>``."""
    own = [(f"{BUFFER}{n}", b) for n, b in module.named_buffers(recurse=False)] if module is not None else []
    for key, t in [*enumerate(args), *kwargs.items(), *own]:
        if not isinstance(t, torch.Tensor) or tracker.is_sharded(t) or t.dim() < 2:
            continue
        dims = [d for d in range(t.dim() - 1) if t.shape[d] in tracker.heads]
        if dims:
            tracker.head_inputs[id(t)] = (name, key, dims[0])


def follow(tracker, inputs: list[torch.Tensor], out) -> None:
    """An op of one candidate alone (MPT's ``position_bias[:, q:, k:]``) keeping its rank: still it."""
    found = [t for t in inputs if id(t) in tracker.head_inputs]
    if len(found) == 1 and len(inputs) == 1 and isinstance(out, torch.Tensor) and out.dim() == found[0].dim():
        tracker.head_inputs[id(out)] = tracker.head_inputs[id(found[0])]


def per_rank_product(tracker, inputs: list[torch.Tensor], out) -> None:
    """An op of a tensor made at each rank's own head count (``from_split_shape``: MiniMax's recurrent
    state ``zeros(batch, self.num_attention_heads, ...)``) with candidates (its ``block_decay``, from a
    per-head buffer): made per rank too, the candidates each rank's heads (``meets_split``)."""
    if not isinstance(out, torch.Tensor) or not any(id(t) in tracker.from_split_shape for t in inputs):
        return
    for t in inputs:
        if id(t) not in tracker.from_split_shape and id(t) in tracker.head_inputs:
            meets_split(tracker, t)
    tracker.from_split_shape.add(id(out))


def meets_split(tracker, t: torch.Tensor, sources: frozenset[str] = frozenset()) -> bool:
    """Whether per-head ``t`` meeting split activations is a candidate handed to the running module:
    recorded (``found_head_inputs``: module -> {argument: its heads dim}) rather than a violation. One
    with gradients must be computed from parameters alone (``params_behind``): their gradients are
    summed over TP (``partial_grads``)."""
    entry = tracker.head_inputs.get(id(t))
    if entry is None or not tracker.running or entry[0] != tracker.running[-1]:
        return False
    if t.requires_grad:
        params = params_behind(tracker, t)
        if not params:
            return False
        for pid in params:
            tracker.head_grads.setdefault(pid, (frozenset(sources), tracker.owner(pid)))
    module, key, dim = entry
    tracker.found_head_inputs.setdefault(module, {})[key] = dim
    return True


def whole_use(tracker, inputs: list[torch.Tensor]) -> None:
    """An op of whole tensors combining a candidate carrying gradients with others: the parameters behind it
    meet whole activations there (their gradients would be counted on every rank)."""
    if len(inputs) < 2:
        return
    for t in inputs:
        if id(t) in tracker.head_inputs and t.requires_grad:
            tracker.head_whole |= params_behind(tracker, t) or frozenset()


def params_behind(tracker, t: torch.Tensor) -> frozenset[int] | None:
    """The ids of the parameters ``t``'s gradient flows into (its autograd graph's leaves, on meta too), or
    None where one is the input embedding's (``t`` is computed from activations) or a leaf is no parameter."""
    if id(t) not in tracker.behind:
        found: set[int] = set()
        seen, stack = set(), [t.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            leaf = getattr(fn, "variable", None)
            if leaf is not None and (id(leaf) not in tracker.params or id(leaf) in tracker.embedding_params):
                found = set()
                break
            if leaf is not None:
                found.add(id(leaf))
            stack.extend(f for f, _ in fn.next_functions)
        tracker.behind[id(t)] = frozenset(found) or None
    return tracker.behind[id(t)]


def partial_grads(tracker, names: dict[int, str]) -> list[str]:
    """The parameter FQNs (``names``: id -> fqn) behind candidates with gradients that met split activations
    only: summed over TP; one whose candidate met whole activations too is a violation instead."""
    why = "a per-head tensor computed from {} meets both split and whole activations"
    return summed_or_violations(tracker, tracker.head_grads, tracker.head_whole, names, why)


def declare_head_input_records(tracker) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    tracker.head_inputs: dict[int, tuple[str, int | str, int]] = {}
    tracker.found_head_inputs: dict[str, dict[int | str, int]] = {}
    tracker.behind: dict[int, frozenset[int] | None] = {}  # id(candidate) -> ``params_behind``
    tracker.embedding_params: set[int] = set()  # ids of the input embedding's parameters (``trace_model``)
    tracker.head_grads: dict[int, tuple[frozenset[str], str]] = {}  # id(param) -> (sources met, its owner)
    tracker.head_whole: set[int] = set()  # ids of parameters behind candidates met by whole activations
