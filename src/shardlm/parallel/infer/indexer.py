"""DeepSeek Sparse Attention's indexer split by its query heads (DeepSeek-V3.2, GLM-DSA, AXK2, dots3).

The indexer (transformers' ``DeepseekV32Indexer`` and its copies) scores every earlier token t for every
query s with ``n_heads`` query heads against one key head,
``index_score[s, t] = n_heads ** -0.5 * sum_h w[s, h] * relu(q[s, h] . k[t]) * scale``, and keeps the
``index_topk`` best tokens; its forward runs under ``no_grad`` (no gradient reaches its parameters or
inputs). The sum over heads is a sum: each rank computes it over its own heads (``wq_b`` and
``weights_proj`` column-parallel, ``n_heads`` local), and the ranks' sums, all-reduced before the top-k
(``runtime/indexer.py``), are one process's scores, so the top-k picks the same tokens. The one key head
(``wk``, its ``k_norm``) is computed whole by every rank. The trace cannot follow a sum that ends in a
top-k (its result is an index tensor, no split activation), so it keeps the indexer whole; it is found
here by its structure and split after the trace, the split checked by the dry run at one rank's shapes.
"""

from __future__ import annotations

import torch.nn as nn

from shardlm.parallel.infer.dry_run import dry_run
from shardlm.parallel.infer.trace import Traced
from shardlm.parallel.model.hf import is_linear, out_features
from shardlm.parallel.plan.plan import Plan

_HEADS = ("wq_b", "weights_proj")  # split by the indexer's query heads; ``wk`` (the one key head) stays whole


def is_indexer(m: nn.Module) -> bool:
    """Whether ``m`` is shaped as a DSA indexer: ``wq_b`` (n_heads x head_dim outputs), ``weights_proj``
    (n_heads), ``wk`` (head_dim: one key head) and an ``index_topk`` (HY-v4's, GLM-DSA's, ... by structure)."""
    heads, dim = getattr(m, "n_heads", None), getattr(m, "head_dim", None)
    children = [getattr(m, c, None) for c in (*_HEADS, "wk")]
    if not (isinstance(heads, int) and isinstance(dim, int) and isinstance(getattr(m, "index_topk", None), int)):
        return False
    if not all(c is not None and is_linear(c) for c in children):
        return False
    return [out_features(c) for c in children] == [heads * dim, heads, dim]


def find_indexers(model: nn.Module, tp: int) -> list[str]:
    """The DSA indexers of ``model`` (``is_indexer``) with ``n_heads`` divisible by ``tp``."""
    return [name for name, m in model.named_modules() if is_indexer(m) and m.n_heads % tp == 0]


def split_indexers(model: nn.Module, plan: Plan, tp: int, traced: Traced, forced: frozenset[str]) -> frozenset[str]:
    """Split the query heads of each indexer the trace kept whole (module docstring); the linears still
    kept whole returned. An indexer whose split the dry run refuses stays whole."""
    for name in find_indexers(model, tp):
        linears = {f"{name}.{c}" for c in _HEADS}
        if not linears <= forced:
            continue
        kept = dict(plan.styles)
        heads = model.get_submodule(name).n_heads
        for fqn in linears:
            plan.styles[fqn] = "colwise"
        plan.local_sizes[name] = {"n_heads": heads // tp}
        if dry_run(model, plan, tp, traced) is not None:
            plan.styles = kept
            plan.local_sizes.pop(name)
            continue
        plan.indexers[name] = heads
        forced = forced - linears
    return forced
