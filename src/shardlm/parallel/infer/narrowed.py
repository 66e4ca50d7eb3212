"""A row-parallel output that is one value per head: each rank keeps its own heads' columns (``Plan.narrowed``).

Doge's dynamic mask: ``dt_proj`` (kv heads x head_dim -> kv heads) reads the split values of every kv head and
gives one value per kv head, which its per-head ``A`` scales and which then masks that head's scores. Row-
parallel, its output is all-reduced whole on every rank, so the mask is made for every head and would meet
each rank's own heads' scores (a per-head tensor not split with the heads). Each rank needs only its heads'
columns of it: the output is *narrowed* to the rank's chunk of columns after the all-reduce
(``runtime/linear.Rowwise("narrowed")``), and since the backward of that narrowing gives each rank the
gradient of its own columns only, the backward of the all-reduce sums them over TP (as for a ``summed``
output: ``summed.py``), whole again for the linear's weight and input.

Found by the trace: the row-parallel linears of the running module a per-head tensor meeting split
activations is computed from are candidates (``candidate``); traced again with its output split by its
columns (``mark``), what follows is checked like any split tensor (``A`` follows the columns, ``follow.py``).
Where tp does not divide its width (fewer kv heads than tp), it is not narrowed (``narrowable``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlm.parallel.model.hf import out_features


def candidate(tracker, t: torch.Tensor) -> None:
    """A per-head tensor ``t`` meeting split activations in the running module: the row-parallel linears
    of that module (its children) of one output per head whose output it is computed from (found in its
    autograd graph, meta tensors have one) become candidates. Not another module's, nor a linear back into
    the residual stream (Gemma 3n's AltUp streams, as many as the heads, meet split activations in its
    decoder layer: its o_proj and down_proj are no candidates)."""
    here = tracker.running[-1] if tracker.running else None
    seen, stack = set(), [t.grad_fn]
    while here is not None and stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        name = tracker.rowwise_fns.get(fn)
        if name is not None:  # not further: what it read is split, and earlier blocks are not this module's
            if name.rpartition(".")[0] == here and tracker.widths.get(name) in tracker.heads:
                tracker.narrow.add(name)
            continue
        stack.extend(f for f, _ in fn.next_functions)


def record(tracker, name: str, out) -> None:
    """The output of row-parallel linear ``name``, by the autograd node that made it (``candidate``)."""
    if isinstance(out, torch.Tensor) and out.grad_fn is not None:
        tracker.rowwise_fns[out.grad_fn] = name


def mark(tracker, name: str, out: torch.Tensor) -> None:
    """The output of narrowed linear ``name``: split by its columns, this linear its source."""
    tracker.mark(out, frozenset({name}))
    tracker.layouts[id(out)] = (-1, (out.shape[-1],))
    tracker.cuts.origins[id(out)] = (name, 0)


def narrowable(found: set[str], narrowed: frozenset[str], meta: nn.Module, tp: int) -> frozenset[str]:
    """The candidates ``found`` not narrowed yet whose width tp divides."""
    return frozenset(f for f in found - narrowed if out_features(meta.get_submodule(f)) % tp == 0)


def declare_narrowed_records(tracker, narrowed: frozenset[str]) -> None:
    """The records this concept keeps on the ``ShardTracker``: the linears narrowed in this trace, the candidates."""
    tracker.narrowed = narrowed
    tracker.narrow: set[str] = set()
    tracker.rowwise_fns: dict = {}  # autograd node -> the row-parallel linear whose output it made
