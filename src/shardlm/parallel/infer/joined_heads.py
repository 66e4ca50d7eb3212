"""Heads that span several projections' outputs: each rank computes the rows of its own heads.

A split dim made by concatenating several column-parallel linears' whole outputs and then viewed into
heads (``layouts.Cuts.head_views``) holds, on each rank, its chunk of every linear's output: viewed
into heads, those are not the rank's heads of the concatenation (its contiguous run of them, the heads
its query heads meet). Zaya's CCA projection makes its value of ``cat(v_proj_current, v_proj_delayed)``
viewed into kv heads of ``head_dim`` channels, each linear ``kv_heads * head_dim / 2`` wide: the first
half of the kv heads are all of ``v_proj_current``, the second all of ``v_proj_delayed``, so a colwise
split would give rank 0 (at tp=2) the first half of each instead of its heads, all of
``v_proj_current``. Each rank instead computes and stores its rows of the concatenation (its heads'
rows), whatever linear they come from (``Plan.stored_rows``: a colwise linear whose weight and bias are
``shards.RowsShard``): a rank holds all of a linear, part of it, or none where its heads lie in
another's, and the attention's bytes per rank are 1/tp as a plain split's. Their gradients need no sum
over TP (each rank's rows are its own); their input's, a partial sum, joins the sibling colwise layers'.
"""

from __future__ import annotations

import torch.nn as nn

from shardlm.errors import ConfigError
from shardlm.parallel.model.hf import out_features
from shardlm.parallel.plan.plan import Plan


def slice_joined_heads(
    model: nn.Module, plan: Plan, head_views: frozenset[tuple[tuple[tuple[str, int], ...], int]], tp: int
) -> None:
    """Set ``plan.stored_rows`` for the linears of every concatenation viewed into heads of ``channels``
    (``head_views``: the linears and their widths, in order); refuse a tp that does not divide the heads
    of the concatenation."""
    for pieces, channels in sorted(head_views):
        linears = [name for name, _ in pieces]
        if any(plan.styles.get(n) != "colwise" or n in plan.sliced or n in plan.stored_rows for n in linears):
            continue  # kept whole (or sliced, or placed by rows already): each rank holds its heads as they are
        if any(w != out_features(model.get_submodule(n)) for n, w in pieces) or len(set(linears)) < len(linears):
            continue  # not whole outputs: the trace's ``whole`` outputs only
        total = sum(w for _, w in pieces)
        if total % (tp * channels):
            raise ConfigError(
                f"parallel.tp={tp} does not divide the {total // channels} heads made of "
                f"{' + '.join(linears)}; choose a tp that divides them"
            )
        share = total // tp
        start = 0
        for name, width in pieces:
            rows = []
            for r in range(tp):
                a, b = max(start, r * share), min(start + width, (r + 1) * share)
                rows.append([(a - start, b - start)] if a < b else [(0, 0)])
            plan.stored_rows[name] = rows
            start += width
