"""Attention with one shared key=value head split by its query heads (DeepSeek-V4's ``DeepseekV4Attention``).

Its queries come through a low-rank latent (``q_a_proj`` -> ``q_a_norm`` -> ``q_b_proj``, per head); its
keys and values are ONE head (``kv_proj`` -> ``kv_norm``: ``[B, 1, S, head_dim]``, read as both key and
value by every query head, ``num_key_value_groups == num_heads``), to which its compressor (CSA/HCA:
windows of the sequence pooled into more entries of that head) appends; a per-head ``sinks``; the
heads' output projected by groups of heads (``o_a_proj``, a grouped linear: ``o_groups`` blocks on the
diagonal) then mixed (``o_b_proj``). The trace keeps it whole: the one key head meets every query head
(a per-head tensor not split with them), and the compressor's windows are longer than the trace.

Split here by structure, the split checked by the dry run at one rank's shapes, as multi-query
attention's single kv head is (``autotp``'s ``sliced``): each rank computes its query heads
(``q_b_proj`` column-parallel, ``sinks`` per head), the key=value head and all of the compressor whole
(stored replicated), its heads' groups of ``o_a_proj`` (its rows by groups, ``o_groups`` local: each
rank's heads are whole groups when tp divides ``o_groups``) and ``o_b_proj`` row-parallel. Everything
computed whole then carries *partial* gradients (each rank's from its own heads): as MLA's latents
(``latent.py``), the linears reading the attention's input are ``sliced`` colwise linears of all their
rows (their input's gradient and their own summed over TP), the norms reading them
``replicate_grad_allreduce``, the compressor's own ``position_bias`` summed over TP (``Plan.partial_grads``).
The compressor's indexer (CSA) ends in a top-k: no gradient reaches it, it stays whole (listed among the
modules kept replicated, with that property: ``properties.py``) and needs no sum.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from shardlm.parallel.infer.dry_run import split_if_exact
from shardlm.parallel.infer.trace import Traced
from shardlm.parallel.model.hf import is_linear, out_features
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import ExpertParam

_LINEARS = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj")
_WHOLE = ("q_a_proj", "kv_proj")  # read the attention's input, computed whole (partial gradients)


def is_shared_kv(m: nn.Module) -> bool:
    """Whether ``m`` is shaped as an attention with one shared key=value head: ``num_heads`` query heads
    of ``head_dim`` (``q_b_proj``), ONE key=value head (``kv_proj``: head_dim outputs) repeated over all
    (``num_key_value_groups == num_heads``), a grouped output projection (``o_a_proj.n_groups``) and
    ``o_b_proj``."""
    heads, dim = getattr(m, "num_heads", None), getattr(m, "head_dim", None)
    if not (isinstance(heads, int) and isinstance(dim, int) and getattr(m, "num_key_value_groups", None) == heads):
        return False
    children = [getattr(m, c, None) for c in _LINEARS]
    if not all(isinstance(c, nn.Linear) for c in children):
        return False
    groups = getattr(m.o_a_proj, "n_groups", None)
    return isinstance(groups, int) and [out_features(m.q_b_proj), out_features(m.kv_proj)] == [heads * dim, dim]


def find_shared_kv(model: nn.Module, tp: int) -> list[str]:
    """The shared key=value attentions of ``model`` whose heads and output groups tp divides."""
    return [
        name
        for name, m in model.named_modules()
        if is_shared_kv(m) and m.num_heads % tp == 0 and m.o_a_proj.n_groups % tp == 0
    ]


def split_shared_kv(model: nn.Module, plan: Plan, tp: int, traced: Traced, forced: frozenset[str]) -> frozenset[str]:
    """Split the query heads of each shared key=value attention the trace kept whole (module docstring);
    the linears still kept whole returned. One whose split the dry run refuses stays whole."""
    for name in find_shared_kv(model, tp):
        attn = model.get_submodule(name)
        under = {f"{name}.{n}" for n, m in attn.named_modules() if n and is_linear(m)}
        if not under <= forced:
            continue
        if not split_if_exact(model, plan, tp, traced, partial(_place, model, plan, name, tp)):
            continue
        plan.shared_kv.append(name)
        forced = forced - {f for f in under if ".indexer." not in f}  # the indexer stays whole: no gradient
    return forced


def _place(model: nn.Module, plan: Plan, name: str, tp: int) -> None:
    attn = model.get_submodule(name)
    q_b = f"{name}.q_b_proj"
    for lat in _WHOLE:
        plan.styles[f"{name}.{lat}"] = "colwise"
        plan.sliced[f"{name}.{lat}"] = [[(0, out_features(getattr(attn, lat)))] for _ in range(tp)]
    for norm, lat in (("q_a_norm", "q_a_proj"), ("kv_norm", "kv_proj")):
        plan.styles[f"{name}.{norm}"] = "replicate_grad_allreduce"
        plan.latent_readers[f"{name}.{norm}"] = f"{name}.{lat}"
    plan.styles[q_b] = "colwise"
    plan.latent_readers[q_b] = f"{name}.q_a_proj"
    plan.styles[f"{name}.o_b_proj"] = "rowwise"
    o_a = f"{name}.o_a_proj"
    plan.styles[o_a] = "per_channel"
    plan.experts[o_a] = {"weight": ExpertParam(0)}
    plan.channels[o_a] = {"weight": q_b}
    plan.local_sizes[o_a] = {"n_groups": attn.o_a_proj.n_groups // tp}
    # every local query head reads the one key=value head (not the config's kv heads: ``local_geometry``)
    plan.local_sizes[name] = {
        "config.o_groups": attn.o_a_proj.n_groups // tp,
        "num_key_value_groups": attn.num_heads // tp,
    }
    if isinstance(getattr(attn, "sinks", None), nn.Parameter):
        plan.styles[name] = "per_channel"
        plan.experts[name] = {"sinks": ExpertParam(0)}
        plan.channels[name] = {"sinks": q_b}
    else:
        plan.styles[name] = "replicate_own"
    plan.attention.append(name)
    compressor = getattr(attn, "compressor", None)
    if compressor is not None:
        _place_compressor(plan, f"{name}.compressor", compressor, tp)


def _place_compressor(plan: Plan, name: str, compressor: nn.Module, tp: int) -> None:
    """The compressor whole on every rank, its partial gradients summed (module docstring); its indexer
    (no gradient) whole."""
    plan.styles[name] = "replicate_own"
    for p, _ in compressor.named_parameters(recurse=False):
        plan.partial_grads.append(f"{name}.{p}")
    for child in ("kv_proj", "gate_proj"):
        plan.styles[f"{name}.{child}"] = "colwise"
        plan.sliced[f"{name}.{child}"] = [[(0, out_features(getattr(compressor, child)))] for _ in range(tp)]
    plan.styles[f"{name}.kv_norm"] = "replicate_grad_allreduce"
    plan.latent_readers[f"{name}.kv_norm"] = f"{name}.kv_proj"
