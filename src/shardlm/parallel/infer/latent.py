"""Multi-head latent attention (MLA) under TP: the low-rank latents whole, the heads split after them.

MLA (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-lite, Kimi, LongCat) factors its query and key/value
projections through small latents: ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (per head),
``kv_a_proj_with_mqa`` (the kv latent and one rope key ``k_rot`` shared by every head) ->
``kv_a_layernorm`` -> ``kv_b_proj`` (per head: k_nope and v), then ``o_proj``. The trace alone
pairs ``q_a_proj`` (column) with ``q_b_proj`` (row), exact but splitting no head; ``latent_
candidates`` finds such a *latent*: a column-parallel linear read by a row-parallel one whose
output is viewed into heads at once. ``autotp`` then keeps the latent whole and traces again, so
that the up-projections read a whole tensor (column-parallel by heads) and ``o_proj`` closes the
pair (row-parallel): one all-reduce per attention forward, as any attention. Kimi-Linear's delta
attention gates are the same pattern: ``f_a_proj`` -> ``f_b_proj`` (+ its per-channel ``dt_bias``,
followed to the view into heads: ``ShardTracker.biased``) and ``g_a_proj`` -> ``g_b_proj``.

The backward: each rank's up-projections and its own heads of the shared rope key (expanded to the
local head count, ``tracker._over_heads``) give the latent's tensors only this rank's share of their
gradient. So the latent's whole region carries *partial* gradients, summed over TP once, at the
latent's input, the attention's input, on the same replicated view as every column-parallel layer
reading it (``linear.column_input``): one all-reduce per attention backward. Hence

* a latent is a ``sliced`` colwise linear of all its rows (``linear.SlicedColwise``: stored replicated,
  its input's gradient summed over TP, its own gradients summed over TP with the other partial ones);
* a module with parameters reading the latent (its norm) is ``replicate_grad_allreduce``;
* a column-parallel linear reading it (``Plan.latent_readers``) takes its input as it is
  (``linear.LatentColwise``): its input gradient is already a partial one, summed upstream.

The trace checks that the partial gradients stay inside: a latent whose tensors meet one computed
whole on every rank (and needing a gradient), or leave the module holding the latent, is not one
(``ShardTracker.latent_leaks``): it is kept replicated the ordinary way, with its sub-block.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from shardlm.parallel.infer.refusals import not_splittable
from shardlm.parallel.model.hf import out_dim, out_features
from shardlm.parallel.plan.plan import Plan


def place_latents(model: nn.Module, plan: Plan, readers: dict[str, set[str]], latents: frozenset[str], tp: int) -> None:
    """Give the latents, their norms and their column-parallel readers the styles above."""
    for fqn in sorted(latents):
        plan.styles[fqn] = "colwise"
        plan.sliced[fqn] = [[(0, out_features(model.get_submodule(fqn)))] for _ in range(tp)]
    for fqn, sources in sorted(readers.items()):
        sources = sources & latents
        if not sources:
            continue
        style = plan.styles.get(fqn)
        if style in ("colwise", "packed_colwise") and fqn not in plan.sliced:
            plan.latent_readers[fqn] = min(sources)
        elif style == "replicate":
            plan.styles[fqn] = "replicate_grad_allreduce"
            plan.latent_readers[fqn] = min(sources)
        else:
            raise not_splittable(
                f"{fqn} ({type(model.get_submodule(fqn)).__name__}) reads the low-rank latent of "
                f"{min(sources)} as a {style} layer"
            )


def check_latent(tracker, name: str, inputs: list[torch.Tensor], latent: frozenset[str]) -> None:
    """A latent's tensors carry partial gradients (each rank's from its own heads, summed over
    TP once, at the latent's input): meeting a tensor that needs a whole gradient (one computed
    whole on every rank, a parameter of a module that does not read the latent) would give it
    a partial one."""
    readers = tuple(f"{r} (" for r in tracker.latent_readers)
    for t in inputs:
        if id(t) in tracker.sharded or id(t) in tracker.latent or not t.requires_grad:
            continue
        owners = tracker.owners(t)
        if owners and all(o.startswith(readers) for o in owners):
            continue  # a parameter of a module reading the latent (its norm): summed over TP too
        for fqn in latent:
            tracker.latent_leaks.setdefault(fqn, f"{name} mixes it with a tensor computed whole on every rank")


def latent_candidates(
    tracker, styles: dict[str, str], outputs: dict[str, torch.Tensor], closer_inputs: dict, meta: nn.Module
) -> dict[str, str]:
    """Column-parallel linears whose split output a row-parallel linear reads and expands into
    heads: its output, whole, is viewed at once as ``[..., heads, head_dim]``.

    That is a low-rank factorization of a per-head projection (MLA: ``q_a_proj`` -> norm ->
    ``q_b_proj``, ``kv_a_proj_with_mqa`` -> norm -> ``kv_b_proj``). The trace pairs the latent
    projection (column) with the up-projection (row), which is exact but leaves the heads whole
    on every rank and the output projection with nothing split to read; kept whole instead, the
    latent (small: it is the rank of the factorization) feeds a column-parallel up-projection
    split by heads, and the output projection closes the pair as in any attention. A factorization
    is low-rank: the latent is narrower than both what it reads and what the up-projection makes of
    it (Gemma 3n's AltUp, whose 4 x 4 prediction coefficients read a projection of the whole residual
    stream, are not one). ``tracker``: the trace's ``ShardTracker`` (its first views and head counts).

    The same pair whose whole output is added to a column-parallel linear's own output of its shape
    (``tracker.rows_beside``; not any split tensor: Doge-MoE's experts' sum, made of its split router's top-k)
    is an adapter beside a split projection (Zamba2's shared MLP adds ``gate_up_proj_adapter_list[i]``, a
    per-invocation down- and up-projection, to the shared ``gate_up_proj``), unless that projection is a misfit
    (``tracker.misfits``: RWKV's value is no adapter, multiplied by its receptance split wrongly): its first
    linear kept whole, the second splits with the projection it is added to, at any rank (its adapter_rank is
    a fixed 128)."""
    out: dict[str, str] = {}
    for name, style in styles.items():
        y = outputs.get(name)
        if style != "rowwise" or y is None or not y.dim():
            continue
        if any(not s & tracker.misfits.keys() for s in tracker.rows_beside.get(name, ())):  # beside no misfit's output
            # the adapter's two linears are siblings (not an o_proj paired with one)
            for source in closer_inputs.get(name, ()):
                if source.rpartition(".")[0] == name.rpartition(".")[0]:
                    out.setdefault(source, name)
            continue
        view = _first_view(tracker, id(y))
        # [..., width] -> [..., heads, head_dim] (a single-head latent [b, 1, s, r] gives [b, s, heads, d])
        if (
            len(view) >= 3
            and view[-2] in tracker.heads
            and view[-2] * view[-1] == y.shape[-1]
            and math.prod(view[:-2]) == math.prod(y.shape[:-1])
        ):
            for source in closer_inputs.get(name, ()):
                if _low_rank(meta.get_submodule(source), y.shape[-1]):
                    out.setdefault(source, name)
    return out


def _low_rank(source: nn.Module, up_width: int) -> bool:
    """Whether linear ``source``'s output (the latent) is narrower than its input and than ``up_width``."""
    rank = out_features(source)
    return rank < source.weight.shape[1 - out_dim(source)] and rank < up_width


def _first_view(tracker, t: int) -> tuple[int, ...]:
    """The shape of the first view of tensor ``t`` or of what a per-channel bias makes of it
    (Kimi-Linear's forget gate: ``(f_b_proj(f_a_proj(x)) + dt_bias).view(..., heads, head_dim)``)."""
    for _ in range(4):
        if t in tracker.first_view or t not in tracker.biased:
            break
        t = tracker.biased[t]
    return tracker.first_view.get(t, ())


def declare_latent_records(tracker) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    # id(tensor) -> id of the first tensor of its shape computed from it and parameters alone (a
    # per-channel bias added: Kimi-Linear's forget gate ``f_b_proj(...) + dt_bias``), for ``latent.py``
    tracker.biased: dict[int, int] = {}
    # MLA (``latent.py``): id(tensor) -> the latents (linears kept whole) it is computed from while
    # still whole on every rank; the modules with parameters reading such tensors; why a latent's
    # partial gradients would reach something computed whole on every rank (then it is not one)
    tracker.latent: dict[int, frozenset[str]] = {}
    tracker.latent_readers: dict[str, frozenset[str]] = {}
    tracker.latent_leaks: dict[str, str] = {}
