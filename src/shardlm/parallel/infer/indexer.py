"""Sparse-attention indexers split by their query heads: DeepSeek Sparse Attention's (DeepSeek-V3.2, GLM-DSA,
AXK2, dots3) and Qwen4-Exp's QSA indexer.

DSA's indexer (transformers' ``DeepseekV32Indexer`` and its copies) scores every earlier token t for every
query s with ``n_heads`` query heads against one key head,
``index_score[s, t] = n_heads ** -0.5 * sum_h w[s, h] * relu(q[s, h] . k[t]) * scale``, and keeps the
``index_topk`` best tokens; its forward runs under ``no_grad`` (no gradient reaches its parameters or
inputs). Qwen4-Exp's QSA indexer (``Qwen4ExpTextQSAIndexer``) scores blocks of ``compress_ratio`` tokens:
``score[s, b] = sum_h relu(q[s, h] . k[b]) / sqrt(head_dim)`` against one key head (``index_kv_heads`` is 1),
the block keys pooled from one fused ``index_qk_proj`` whose rows are [the query heads | the key head]
(``split_with_sizes``), and keeps the ``block_topk`` best; it returns a boolean mask (no gradient reaches it).

Either sum over heads is a sum: each rank computes it over its own heads (DSA: ``wq_b`` and ``weights_proj``
column-parallel, ``n_heads`` local; QSA: ``index_qk_proj`` packed as [query heads | key head], each rank
computing its chunk of the query rows and the whole key head, ``index_n_heads`` local), and the ranks' sums,
all-reduced before the top-k (``runtime/indexer.py``), are one process's scores, so the top-k picks the same
tokens. The one key head (DSA's ``wk`` and its ``k_norm``; QSA's key rows and ``k_layernorm``) is computed
whole by every rank. The trace cannot follow a sum that ends in a top-k (its result is an index tensor, no
split activation), so it keeps the indexer whole; it is found here by its structure and split after the
trace, the split checked by the dry run at one rank's shapes.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from shardlm.parallel.infer.dry_run import split_if_exact
from shardlm.parallel.infer.trace import Traced
from shardlm.parallel.model.hf import is_linear, out_features
from shardlm.parallel.plan.plan import Plan

_HEADS = ("wq_b", "weights_proj")  # split by the indexer's query heads; ``wk`` (the one key head) stays whole
_QSA_FUSED = "index_qk_proj"  # [index_n_heads query heads | one key head] x index_head_dim rows


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


def is_qsa_indexer(m: nn.Module) -> bool:
    """Whether ``m`` is shaped as Qwen4-Exp's QSA indexer: ``index_qk_proj`` of (``index_n_heads`` + one key
    head) x ``index_head_dim`` outputs, and a ``block_topk``."""
    heads, kv, dim, topk = (
        getattr(m, a, None) for a in ("index_n_heads", "index_kv_heads", "index_head_dim", "block_topk")
    )
    fused = getattr(m, _QSA_FUSED, None)
    if not (isinstance(heads, int) and kv == 1 and isinstance(dim, int) and isinstance(topk, int)):
        return False
    return fused is not None and is_linear(fused) and out_features(fused) == (heads + 1) * dim


def _heads(m: nn.Module) -> int:
    return m.n_heads if is_indexer(m) else m.index_n_heads


def find_indexers(model: nn.Module, tp: int) -> list[str]:
    """The indexers of ``model`` (``is_indexer``, ``is_qsa_indexer``) with query heads divisible by ``tp``."""
    found = [(name, m) for name, m in model.named_modules() if is_indexer(m) or is_qsa_indexer(m)]
    return [name for name, m in found if _heads(m) % tp == 0]


def _split_dsa(plan: Plan, name: str, m: nn.Module, tp: int) -> None:
    """``wq_b`` and ``weights_proj`` column-parallel, ``n_heads`` local."""
    for child in _HEADS:
        plan.styles[f"{name}.{child}"] = "colwise"
    plan.local_sizes[name] = {"n_heads": m.n_heads // tp}


def _split_qsa(plan: Plan, name: str, m: nn.Module, tp: int) -> None:
    """``index_qk_proj`` packed as [query heads | key head], the key part whole on every rank (its parameters
    stored whole, each rank computing its query rows and the key's: ``Plan.sliced``), ``index_n_heads`` local."""
    fqn, queries, key = f"{name}.{_QSA_FUSED}", m.index_n_heads * m.index_head_dim, m.index_head_dim
    plan.styles[fqn] = "packed_colwise"
    plan.parts[fqn], plan.whole_parts[fqn] = [queries, key], [False, True]
    plan.sliced[fqn] = [[(r * queries // tp, (r + 1) * queries // tp), (queries, queries + key)] for r in range(tp)]
    plan.local_sizes[name] = {"index_n_heads": m.index_n_heads // tp}


def split_indexers(model: nn.Module, plan: Plan, tp: int, traced: Traced, forced: frozenset[str]) -> frozenset[str]:
    """Split the query heads of each indexer the trace kept whole (module docstring); the linears still
    kept whole returned. An indexer whose split the dry run refuses stays whole."""
    for name in find_indexers(model, tp):
        m = model.get_submodule(name)
        dsa = is_indexer(m)
        linears = {f"{name}.{c}" for c in (_HEADS if dsa else (_QSA_FUSED,))}
        if not linears <= forced:
            continue
        if not split_if_exact(model, plan, tp, traced, partial(_split_dsa if dsa else _split_qsa, plan, name, m, tp)):
            continue
        # the factor of the summed scores: DSA's ranks each scale their sums by ``local ** -0.5``, one process
        # by ``n_heads ** -0.5``; QSA's scores are plain sums over the heads
        plan.indexers[name] = tp**-0.5 if dsa else 1.0
        forced = forced - linears
    return forced
