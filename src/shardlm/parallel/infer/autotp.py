"""AutoTP: derive a tensor-parallel plan for a Hugging Face causal LM from its dataflow.

The dataflow comes from one traced meta forward (``parallel/infer/trace.py``); this module turns it into
a plan: styles, what stays replicated and why, the dry run at one rank's shapes, the refusals.

A plan is ``{module_fqn: style}``; the style vocabulary (``styles.Style``; what each shards: ``styles.PLACEMENTS``):

``colwise``  Linear/Conv1D sharded by output features: it reads a replicated activation
``rowwise``  Linear/Conv1D sharded by input features: it reads a sharded activation and its
             output is all-reduced (back into the residual stream)
``packed_colwise``  a fused colwise projection (qkv, gate_up, GPT-2's c_attn) whose output is
             split into parts downstream: each part is sharded on its own, so every rank holds
             whole heads / matching halves
``embedding`` token embedding sharded by vocabulary rows
``lm_head``  output projection sharded by vocabulary; the loss runs on the vocab shards
``replicate_grad_allreduce``  parameters acting on sharded activations per head (Qwen3's
             q_norm/k_norm): replicated, gradients summed over the TP group
``sharded_norm``  an RMSNorm across a whole sharded width (OLMo-2's q_norm/k_norm after
             column-parallel q/k): weight sharded like its input, the mean of squares all-reduced
``per_channel``  parameters acting per channel or per head on a column-parallel linear's split
             output (Qwen3.5 DeltaNet's depthwise ``conv1d``, ``A_log``, ``dt_bias``): split like
             its rows; a module using them directly computes on local views (``channels.py``)
``replicate`` every other module owning parameters (norms, linears of sub-blocks kept whole); in
             a finished plan it becomes ``replicate_local`` or ``replicate_own`` (below)
``replicate_local``  learned position embeddings (they make position tensors of their own), and
             a module that uses its children's parameters directly (a mixer calling
             ``conv1d(x, self.conv1d.weight)``) with everything under it, none of it split:
             parameters replicated, the module computes on local views of them; also every
             ``replicate`` module with nothing split under it (``_run_local``)
``replicate_own``  a module with parameters of its own around split children (HRM's initial
             state): its own parameters only, replicated, computed on as local views

What cannot be split is kept replicated, sub-block by sub-block, or refused; never guessed:

* every split tensor carries its *sources* (the column-parallel linears it came from). A module
  or parameter that would act on split activations and is none of the above (a depthwise
  ``conv1d`` over channels whose split the trace cannot follow, as over Mamba-2's [x, B, C] cut
  only after the conv, a state-space parameter not aligned with split channels, a learned
  activation), or a per-head
  tensor that is not split with the heads (BLOOM's and MPT's ALiBi slopes, position biases:
  found as a non-parameter tensor sharing the head-count dim of a split one, the trace using
  batch 1 and a prime sequence length so the sizes cannot be confused), is a *violation*: its
  sources, the row-parallel linears reading them and the column-parallel linears feeding those
  stay replicated (``Plan.replicated``, with the reason) and the trace runs again. Replicated
  modules compute the whole sub-block on every rank: exact, just not split.
* the plan is then dry-run on meta at one rank's shapes (``dry_run.py``): what only breaks there
  (Falcon's multi-query ``num_heads + 2`` reshape, GPT-BigCode's multi-query split sizes) or
  silently regroups (CodeGen's qkv fused in ``mp_num`` groups of ``[q, v, k]``, whose local
  reshape runs but groups the wrong columns) keeps the owning sub-block replicated too.
* a module whose code uses its children's parameters directly (Mamba and short-convolution
  mixers call ``conv1d(x, self.conv1d.weight)``), with nothing under it split, becomes
  ``replicate_local``, and so does a module with parameters of its own around whole children
  (gpt-oss's attention, kept whole, owns per-head sinks: ``_run_local``); where
  something under it is split, the parameters' owner is kept whole and the user computes on local
  views of them (``Plan.direct_reads``: Gemma 3n's decoder layer running AltUp's ``predict`` itself);
  where that owner is split, or a parameter is shared by modules of different styles (BERT's
  LM-head bias), the model is refused (``_refuse_unplaceable``).
* mixture-of-experts layers whose experts are fused 3-D parameters (transformers 5's
  ``...Experts`` modules) get the ``experts`` style: each expert's intermediate dim split, the
  placement of every parameter found by a probe run of the module (``parallel/infer/experts.py``), the
  router and shared experts placed by the trace like any other module; the trace runs the
  experts eagerly (on meta the loop over hit experts is empty: they are opaque to it). Any other
  MoE layer is kept whole on every rank, its linears replicated, with the model's property that keeps
  the probes from it (``experts.whole_moe_layers``); a model none of whose
  block layers can be split, and any unexpected exception while tracing becomes a
  one-line ``ConfigError`` naming the module that was running: ``shardlm plan`` and ``train``
  never show a traceback, and ``parallel.fsdp`` trains all of these.
* multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): a column-parallel linear read by a
  row-parallel one whose output is viewed into heads at once is a low-rank latent
  (``latent.latent_candidates``): kept whole and traced again, so the heads split after it; its
  region carries partial gradients summed over TP at its input (``parallel/infer/latent.py``), or, where
  they would leak, it is kept replicated with its sub-block.
* attentions split by their structure after the trace, the split checked by the dry run: DeepSeek
  Sparse Attention's indexer (``indexer.py``), DeepSeek-V4's heads around one shared key=value head
  (``shared_kv.py``).
* data-dependent questions modeling files ask (``pad_token_id in input_ids``, ``.item()``) are
  answered on meta without data (``parallel/infer/meta_answers.py``).

Two cases keep their style word but are recorded in ``Plan.sliced`` (output rows each rank
computes) and stored *replicated* on the TP mesh, gradients summed over TP:

* fewer key/value heads than ``tp`` (GQA, MQA): a k/v projection (a colwise linear of width
  ``kv_heads * head_dim`` beside a query projection) is held whole; rank r computes only the kv
  head its query heads read, ``r // (tp // kv_heads)``. Ranks sharing a kv head each produce
  part of its gradient (the part from their query heads); rows of other heads get zero, so the
  sum over TP is the full gradient.
* a packed projection with a part some ranks share: a kv head replicated when ``KV < tp`` (Phi-3's
  qkv_proj), or a part every rank needs whole (Mamba-2's B and C at ``n_groups < tp``): held whole,
  rank r computes its chunk of every other part and those rows.

A packed projection of unequal parts each split (Phi-3 with GQA at ``KV >= tp``, Qwen3.5's q|k|v,
Mamba-2's [z, x, B, C, dt]) is sharded like one of equal parts, rank r holding its chunk of each
(``shards.PartsShard``).
"""

from __future__ import annotations

import copy
import json
import re

import torch.nn as nn

from shardlm.errors import ConfigError
from shardlm.parallel.infer.channels import channel_placements, keep_whole_widths, local_sizes, place_channels
from shardlm.parallel.infer.direct_reads import read_whole
from shardlm.parallel.infer.dry_run import dry_run
from shardlm.parallel.infer.experts import find_experts, own_forward_routers, place_experts, whole_moe_layers
from shardlm.parallel.infer.head_einsums import head_placements, place_head_einsums
from shardlm.parallel.infer.indexer import split_indexers
from shardlm.parallel.infer.joined_heads import slice_joined_heads
from shardlm.parallel.infer.latent import place_latents
from shardlm.parallel.infer.narrowed import narrowable
from shardlm.parallel.infer.probe import WHY, NotTail, Probe, depends_on_values, materialize
from shardlm.parallel.infer.properties import model_property
from shardlm.parallel.infer.refusals import FSDP_TRAINS_IT, any_block, cannot_split, not_splittable
from shardlm.parallel.infer.shared_kv import split_shared_kv
from shardlm.parallel.infer.sizes import used_only
from shardlm.parallel.infer.summed import place_direct, place_summed
from shardlm.parallel.infer.trace import RUNNING_NOTE, Traced, dropout_dims, trace_model
from shardlm.parallel.infer.unrun import split_like, unrun
from shardlm.parallel.infer.vocab_head import check_vocab_head
from shardlm.parallel.model.geometry import Geometry, read_geometry
from shardlm.parallel.model.hf import (
    MODULE_KV_COUNT_ATTRS,
    is_linear,
    looks_up_rows,
    lookup_norm,
    out_features,
)
from shardlm.parallel.model.meta import build_meta
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.rows import chunk_rows
from shardlm.parallel.plan.styles import SPLIT_LINEAR, SPLIT_STYLES


def _hf_directions(model: nn.Module) -> dict[str, str]:
    """The model's own ``base_model_tp_plan`` reduced to colwise/rowwise per FQN, for the cross-check."""
    raw = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "model")
    out = {}
    for pattern, style in raw.items():
        direction = (
            "colwise"
            if style.startswith(("colwise", "packed_colwise"))
            else "rowwise"
            if style.startswith("rowwise")
            else None
        )
        if direction is None:
            continue
        regex = re.compile(re.escape(f"{prefix}.{pattern}").replace(r"\*", r"\d+") + "$")
        for name, _ in model.named_modules():
            if regex.match(name):
                out[name] = direction
    return out


def _module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    for name, module in model.named_modules():
        if module is target:
            return name
    return None


def infer_plan(model: nn.Module, tp: int) -> Plan:
    """The full plan for ``model`` (meta or real) at TP degree ``tp``.

    Whatever the trace cannot handle ends as a ``ConfigError`` naming the module (one line for the
    CLI, raised before any rank is spawned), never as a traceback: an unexpected exception while
    tracing means a modeling file does something the trace does not know yet, so the model is
    refused for tp > 1 rather than guessed at.
    """
    check_config_geometry(model.config, tp)
    if tp == 1:
        return Plan()
    # the modules too, not only the config: the same config traced with LoRA layers injected (or
    # without) is another plan, and a process that builds both must not hand one the other's
    modules = tuple((name, type(m).__name__) for name, m in model.named_modules())
    key = (type(model).__name__, tp, json.dumps(model.config.to_dict(), sort_keys=True, default=str), modules)
    if key not in PLANS:
        PLANS[key] = _infer_or_refuse(model, tp)
    return copy.deepcopy(PLANS[key])


# plans already traced in this process (a model's plan is traced again by parallelize, estimate, LoRA checks)
PLANS: dict[tuple, Plan] = {}


def _infer_or_refuse(model: nn.Module, tp: int) -> Plan:
    try:
        return _infer(model, tp)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring
        notes = [n[len(RUNNING_NOTE) :] for n in getattr(exc, "__notes__", ()) if n.startswith(RUNNING_NOTE)]
        where = notes[0] if notes else type(model).__name__
        detail = " ".join(str(exc).split())[:160]
        raise cannot_split(
            f"{where}: tracing the tensor-parallel plan failed ({type(exc).__name__}: {detail})"
        ) from None


# Every round that does not end the search adds to the modules kept whole (or to the wholes held or outputs
# narrowed, or learns that a latent leaks): it cannot cycle, only the count of rounds is bounded. Hyper-
# connections make it long: Qwen4-exp's low-rank mixing linears are found one per two rounds (a plan in 13); Gemma 3n's
# plan takes 6 (its echoes wait, ``_region``)
_MAX_ROUNDS = 32


def _infer(model: nn.Module, tp: int) -> Plan:
    """Trace, keep replicated every sub-block something in it cannot be split, check the plan by
    running the forward at one rank's shapes (``dry_run``), repeat until nothing changes."""
    experts = find_experts(model, tp)  # MoE: the experts modules' placements, other MoE layers refused
    reasons: dict[str, str] = own_forward_routers(model, experts)  # kept whole from the start (Phi-MoE's)
    reasons.update(_whole_moe(model, whole_moe_layers(model, experts)))  # MoE layers no probe splits
    forced: frozenset[str] = frozenset(reasons)
    latents: frozenset[str] = frozenset()  # MLA: forced linears whose region carries partial gradients
    up: dict[str, str] = {}  # latents proposed -> the up-projection reading each
    wholes: frozenset[tuple[str, int, int]] = frozenset()  # stretches of outputs held whole (Mamba-2's B, C)
    narrowed: frozenset[str] = frozenset()  # row-parallel outputs narrowed to each rank's heads (``narrowed.py``)
    geo, meta = read_geometry(model.config), build_meta(model)  # the geometry read once: the plan carries it
    probes: dict[str, nn.Module] = {}  # modules kept whole, run on CPU tensors (``probe.py``)
    for _ in range(_MAX_ROUNDS):
        try:
            traced = trace_model(model, forced, meta, latents=latents, wholes=wholes, probes=probes, narrowed=narrowed)
        except Exception as exc:  # noqa: BLE001 - a module whose forward depends on tensor values: kept whole
            forced = forced | _keep_whole_on_values(model, exc, probes, reasons)
            continue
        if traced.new_wholes or narrowable(traced.narrow, narrowed, meta, tp):  # held whole / narrowed, again
            wholes, narrowed = wholes | traced.new_wholes, narrowed | narrowable(traced.narrow, narrowed, meta, tp)
            continue
        # MoE: a column-parallel linear of fewer outputs than tp (Qwen2-MoE's shared_expert_gate,
        # hidden -> 1) cannot be split: it stays whole, traced again
        narrow = {f for f, st in traced.styles.items() if st == "colwise" and out_features(meta.get_submodule(f)) < tp}
        if narrow - forced:
            for f in narrow - forced:
                reasons[f] = f"{any_block(f)} has {out_features(meta.get_submodule(f))} output(s), fewer than tp={tp}"
            forced = forced | narrow
            continue
        # MLA (``latent.py``): a latent kept whole, the heads split after it; one whose partial gradients leak
        # kept replicated, with its sibling up-projection, in every block alike (Gemma 3n's AltUp router)
        leaked = latents & set(traced.latent_leaks)
        if leaked:
            pairs = {lat: {lat, up[lat]} if _sibling(lat, up[lat]) else {lat} for lat in leaked}
            cause = {f: lat for lat in sorted(leaked) for f in _every_block(pairs[lat], set(traced.styles))}
            for f in set(cause) - forced | leaked:
                reasons[f] = f"{any_block(cause[f])}, a low-rank latent: {any_block(traced.latent_leaks[cause[f]])}"
            latents, forced = latents - leaked, forced | set(cause)
            continue
        up.update(traced.latents)
        if latent := _new_latents(traced, forced):
            forced, latents = forced | latent, latents | latent
            continue
        if misfit := _misfit(traced, forced, reasons):  # a linear split wrongly (Zamba2's hybrid ``linear``)
            forced = forced | misfit
            continue
        region = _region(traced, forced, reasons)
        if not region and not traced.violations:
            plan = _assemble(model, tp, traced, geo, latents)
            failure = dry_run(model, plan, tp, traced, probes)
            if failure is None:
                place_experts(plan, experts, model, tp)  # MoE: the trace saw the experts replicated (opaque to it)
                plan.experts.update(channel_placements(model, plan))
                plan.experts.update(head_placements(model, plan))  # XLNet's per-head parameters
                _run_local(model, plan)
                _refuse_unplaceable(model, plan, traced)
                plan.dropout_sites = dropout_dims(model, traced, forced, probes)
                forced = split_shared_kv(model, plan, tp, traced, split_indexers(model, plan, tp, traced, forced))
                return _finish(model, plan, forced - latents, reasons)
            owner, why = failure
            split = {f for f, st in traced.styles.items() if st in SPLIT_LINEAR}
            # its own split linears, else every split linear under it (BigBird: attention.self, .output)
            region = {f for f in split if f.rpartition(".")[0] == owner} or {
                f for f in split if f.startswith(f"{owner}.") or not owner
            }
            # the same module of every other block fails alike: one round for all of them
            region = _every_block(region, split) - forced
            why = any_block(why)
            for fqn in region:
                reasons.setdefault(fqn, why)
            if not region:
                raise cannot_split(why)
        if not region:  # violations but nothing new to keep replicated: give up
            raise cannot_split(traced.violations[0][1])
        forced = forced | region
    raise ConfigError(
        f"parallel.tp: {type(model).__name__}: no consistent tensor-parallel plan after {_MAX_ROUNDS} rounds "
        f"({next(iter(reasons.values()), '')}); {FSDP_TRAINS_IT}"
    )


def _keep_whole_on_values(model: nn.Module, exc: Exception, probes: dict[str, Probe], reasons: dict) -> set[str]:
    """The module whose forward raised ``exc`` (the trace's note names it), where its forward depends on
    tensor values (``probe.depends_on_values``), and the same module of every block: traced again with only
    its tail run on CPU tensors (added to ``probes``, ``probe.run_tail``); where that tail is not after all
    its parameters (``probe.NotTail``), kept whole, run on CPU tensors in later traces: returns the linears
    under them, kept replicated (with the reason in ``reasons``). Any other exception, one from a module kept
    whole already or from one holding most of the model, is raised again (``_infer_or_refuse`` refuses the
    model with it)."""
    notes = [n[len(RUNNING_NOTE) :] for n in getattr(exc, "__notes__", ()) if n.startswith(RUNNING_NOTE)]
    whole = isinstance(exc, NotTail)
    running = exc.name if whole else notes[0].rsplit(" (", 1)[0] if notes else ""
    if not whole and (not running or running in probes or not depends_on_values(exc)):
        raise exc
    size = sum(p.numel() for p in model.get_submodule(running).parameters())
    if 2 * size > sum(p.numel() for p in model.parameters()):
        raise exc  # most of the model (its backbone): not materialized on CPU, the model is refused instead
    names = [n for n, _ in model.named_modules()]
    found = _every_block({running}, set(names))
    why = f"{any_block(running)} ({type(model.get_submodule(running)).__name__}): {WHY}"
    linears: set[str] = set()
    for fqn in found:
        probes[fqn] = Probe(materialize(model.get_submodule(fqn)), whole)
        for name, module in model.get_submodule(fqn).named_modules():
            if whole and is_linear(module):
                linears.add(f"{fqn}.{name}")
                reasons.setdefault(f"{fqn}.{name}", why)
    return linears


def _whole_moe(model: nn.Module, layers: dict[str, str]) -> dict[str, str]:
    """The modules holding the experts of each MoE layer kept whole (``whole_moe_layers``), with its reason:
    every module under it (itself too) owning parameters that is no linear layer (3-D experts, embedding
    rows), whole on every rank and listed among the modules kept whole; the linears beside them are the
    trace's like any other (a router reading top-k of its split output is kept replicated, Doge's shared MLP
    split)."""
    return {
        name: why
        for fqn, why in layers.items()
        for name, module in model.get_submodule(fqn).named_modules(prefix=fqn)
        if not is_linear(module) and any(True for _ in module.parameters(recurse=False))
    }


def _block_key(fqn: str) -> str:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.#.attn.c_attn``."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", fqn) + "."


def _every_block(fqns: set[str], candidates: set[str]) -> set[str]:
    """``fqns`` and the same modules in every other block, among ``candidates``."""
    keys = {_block_key(f) for f in fqns}
    return {f for f in candidates if _block_key(f) in keys}


def _alike(bad: set[str], others: set[str], names: set[str]) -> set[str]:
    """Those of ``others`` (the modules of ``bad`` in other blocks) whose block holds the same modules
    (``names``, by path below it) as ``bad``'s: a block of another kind is not alike (Inkling 2's
    full-attention layers convolve keys and values with dynamic taps, its sliding layers with static ones)."""

    def below(fqn: str) -> frozenset[str]:
        block = _block(fqn) + "."
        return frozenset(n[len(block) :] for n in names if n.startswith(block))

    kinds = {_block_key(f): below(f) for f in bad}
    return {f for f in others if kinds.get(_block_key(f)) in (None, below(f))}


def _sibling(a: str, b: str) -> bool:
    """Whether modules ``a`` and ``b`` have the same parent."""
    return a.rpartition(".")[0] == b.rpartition(".")[0]


def _block(fqn: str) -> str:
    """The numbered block ``fqn`` is inside (``model.layers.3`` for ``model.layers.3.mlp.up_proj``), or
    "" around the blocks (``model.altup_projections.0``: a numbered linear, no block)."""
    found = re.match(r"(.*?\.\d+)\.", fqn)
    return found.group(1) if found else ""


def _new_latents(traced: Traced, forced: frozenset[str]) -> set[str]:
    """The latents this trace found (``latent.py``), to keep whole before acting on misfits (``_misfit``).
    While a misfit waits, a latent read in another block is left for the next trace: it may be the misfit's
    doing (Zamba2's mixer out_proj, paired the wrong way round after its hybrid ``linear``, read by the next
    layer's q_proj); with none waiting it is one (Qwen4-exp's hyper-connection ``block_inject_weight``, read
    by the next layer's projections: kept whole from the first trace, as before misfits were found)."""
    latent = set(traced.latents) - forced
    if set(traced.misfits) - forced:
        latent = {f for f in latent if _block(f) == _block(traced.latents[f])}
    return latent


def _misfit(traced: Traced, forced: frozenset[str], reasons: dict[str, str]) -> set[str]:
    """The first column-parallel linear whose output meets a whole activation of its shape (``traced.misfits``:
    Zamba2's hybrid ``linear``, added to the residual stream), in every block alike: kept whole alone, before
    the violations (latents are acted on first, ``_new_latents``: MLA's o_proj is a misfit only while q_b_proj is
    row-parallel; Zamba2's mixer out_proj, split, read by the next layer's q_proj is no latent), which
    wait for the next trace: the linears after it were paired the wrong way round by its split (the mixer's in_proj
    row-parallel, its out_proj column-parallel, a misfit too)."""
    first = next((f for f in traced.misfits if f not in forced), None)
    misfits = _every_block({first}, set(traced.styles)) - forced if first else set()
    for fqn in misfits:
        reasons.setdefault(fqn, any_block(traced.misfits[first]))
    return misfits


def _region(traced: Traced, forced: frozenset[str], reasons: dict[str, str]) -> set[str]:
    """The linears to keep whole after this trace's violations (``reasons``: why, for each new one).

    A violation whose sources strictly contain an earlier one's is an echo: a linear split wrongly
    (Gemma 3n's AltUp projections of the embedding, its AltUp router) splits the residual stream what
    follows reads, and the trace then pairs the linears after it the wrong way round (attention's q/k/v
    row-parallel, its o_proj column-parallel), which meet violations of their own. Where there are
    echoes, only the other violations are acted on, their sub-blocks closed within their own blocks;
    one that an echo follows is acted on in every block alike (the echo hides what the later blocks
    would say); the echoes wait for the next trace, on a whole residual stream."""
    found = [(frozenset(s), why) for s, why in traced.violations if s]
    echoes = [s for k, (s, _) in enumerate(found) if any(e < s for e, _ in found[:k])]
    region: set[str] = set()
    for sources, why in found:
        if sources in echoes:
            continue
        bad = _closure(traced, set(sources), bool(echoes))
        if any(sources < e for e in echoes):  # the cause of an echo: every block alike
            for fqn in _alike(bad, _every_block(bad, set(traced.styles)) - bad, set(traced.styles)):
                bad |= _closure(traced, {fqn}, True)
        for fqn in bad - forced - region:
            reasons.setdefault(fqn, any_block(why))
            region.add(fqn)
    return region


def _closure(traced: Traced, bad: set[str], in_block: bool = False) -> set[str]:
    """``bad`` plus every row-parallel linear reading from it and every column-parallel linear
    feeding those: the whole sub-block, which then stays replicated (``in_block``: only those in
    the blocks of ``bad``, ``_region``)."""
    blocks = {_block(f) for f in bad}
    bad = set(bad)
    changed = True
    while changed:
        changed = False
        for closer, sources in traced.closer_inputs.items():
            if in_block:
                if _block(closer) not in blocks:
                    continue
                sources = {f for f in sources if _block(f) in blocks}
            if sources & bad and not ({closer} | sources) <= bad:
                bad |= {closer} | sources
                changed = True
    return bad


def _assemble(
    model: nn.Module, tp: int, traced: Traced, geometry: Geometry, latents: frozenset[str] = frozenset()
) -> Plan:
    plan = Plan(parts=dict(traced.parts), whole_parts=dict(traced.whole), geometry=geometry)
    plan.narrowed = sorted(f for f in traced.narrowed if traced.styles.get(f) == "rowwise")  # Doge's dt_proj
    styles = dict(traced.styles)
    emb = _module_name(model, model.get_input_embeddings())
    head = _module_name(model, model.get_output_embeddings())
    styles[emb] = "embedding"
    if head is not None:
        styles[head] = "lm_head"
    # parameters the embedding and LM head place (BERT's prediction head owns the LM head's bias too)
    placed = {id(p) for n in (emb, head) if n is not None for p in model.get_submodule(n).parameters(recurse=False)}
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in placed]
        if styles.get(name) is None and own:
            # learned positions make their own position tensors (MVP, XLM): local copies
            styles[name] = "replicate_local" if isinstance(module, nn.Embedding) else "replicate"
    plan.styles = {name: styles[name] for name, _ in model.named_modules() if name in styles}
    place_latents(model, plan, traced.latent_readers, latents, tp)  # MLA
    _follow_aliases(model, plan, set(traced.styles))  # Zamba2's adapters of other invocations
    for fqn, direction in _hf_directions(model).items():
        ours = "colwise" if plan.styles.get(fqn, "").endswith("colwise") else plan.styles.get(fqn)
        plan.agrees_with_hf[fqn] = ours == direction
    # modules whose forward reshapes sharded activations into heads: parents of colwise layers
    sharded = [n for n, s in plan.styles.items() if s.endswith("colwise") and n not in (emb, head)]
    plan.attention = sorted({n.rsplit(".", 1)[0] for n in sharded})
    place_head_einsums(model, plan, traced.head_einsums)  # XLNet's attention: einsums of per-head parameters
    _slice_shared_rows(model, plan, tp)
    slice_joined_heads(model, plan, traced.head_views, tp)  # Zaya's value of cat(v_proj_current, v_proj_delayed)
    plan.head_inputs = {m: dict(found) for m, found in traced.head_inputs.items() if m in plan.attention}
    plan.partial_grads = list(traced.partial_grads)  # DiffLlama's lambdas (``broadcast.py``)
    for user, owner in traced.row_reads.items():  # Gemma 4's pad row (``runtime/row_reads.py``)
        if owner.split(" (")[0] in (emb, head):
            plan.row_reads[user] = emb
        else:
            traced.foreign.setdefault(owner, user)
    place_channels(model, plan, traced.follows, traced.foreign, tp, traced.follow_dims)
    place_direct(model, plan, traced.direct)  # Mamba's dt_proj, multiplied directly by the mixer
    place_summed(model, plan, traced.summed, traced.summed_readers)  # Mamba's x_proj
    whole, split = used_only(traced.int_uses, "whole"), used_only(traced.int_uses, "split")
    reads = {f: r - whole.get(f, set()) for f, r in traced.reads.items() if f in plan.attention}
    local_sizes(model, plan, reads, traced.split_sizes, tp, split)
    keep_whole_widths(model, plan, whole)  # Zaya's CCA ``hidden_size``: the size of a whole input
    plan.unrun = unrun(model, traced)  # cross-attention without encoder states, multimodal towers
    split_like(model, plan)  # a cross-attention like a split self-attention: split as it is
    return plan


def _follow_aliases(model: nn.Module, plan: Plan, ran: set[str]) -> None:
    """A linear reached by several paths with the same parameters (Zamba2's shared block, registered in every
    hybrid layer, holds one adapter per invocation: each runs under one layer's path only): where it never ran
    under a path (not in ``ran``), it takes the placement of the path it ran under, so that its parameters,
    one tensor, are placed once."""
    paths: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if is_linear(module):
            paths.setdefault(id(module.weight), []).append(name)
    for names in paths.values():
        done = [n for n in names if n in ran and plan.styles.get(n) not in (None, "replicate")]
        for fqn in [n for n in names if n not in ran] if done else ():
            src = done[0]
            plan.styles[fqn] = plan.styles[src]
            for table in (plan.parts, plan.whole_parts, plan.sliced):
                if src in table:
                    table[fqn] = copy.deepcopy(table[src])
            if src in plan.latent_readers:
                plan.latent_readers[fqn] = plan.latent_readers[src].replace(_block(src), _block(fqn), 1)


def _run_local(model: nn.Module, plan: Plan) -> None:
    """Every ``replicate`` module with nothing split under it becomes ``replicate_local``, with
    everything under it: whole on every rank, it computes on plain tensors and local views of its
    parameters. As replicated DTensors, the tensors a module makes of its own inside (CPM-Ant's
    relative position buckets, a sliding-window mask, an RG-LRU's recurrent state) would meet
    DTensors (``got mixed torch.Tensor and DTensor``), and a norm's output would be a view that
    modeling code cannot modify in place (XLM's ``tensor *= mask``)."""
    kept = ("replicate", "replicate_local")
    for fqn, style in list(plan.styles.items()):
        if style != "replicate":
            continue
        under = [f for f in plan.styles if not fqn or f.startswith(f"{fqn}.")]
        if any(plan.styles[f] not in kept for f in under):
            continue  # something under it is split (or placed otherwise): ``_refuse_unplaceable``
        for f in [fqn, *under]:
            plan.styles[f] = "replicate_local"


def _refuse_unplaceable(model: nn.Module, plan: Plan, traced: Traced) -> None:
    """What the TP styles cannot place yet, refused before spawning rather than failing in the ranks:

    * a parameter used directly by another module's forward (a mixer calling
      ``conv1d(x, self.conv1d.weight)``) that is split or has its gradients summed over TP: styles
      act at module boundaries, so it would meet plain tensors as a DTensor (where nothing under that
      module is split, it becomes ``replicate_local`` instead: it computes on local copies of its
      parameters; where its owner is kept whole, the user gets local views of them while it runs,
      ``direct_reads.py``: Gemma 3n's AltUp, ProphetNet's position embeddings);
    * a ``replicate_grad_allreduce`` module with parameters of its own around split children (a
      ``replicate`` one becomes ``replicate_own``: its parameters act on whole activations only);
    * a parameter shared by modules with different styles (BERT's LM-head bias, also owned by its
      prediction head), other than tied input/output embeddings;
    * an input embedding or LM head with parameters in submodules, other than an embedding's norm of its
      lookup (Inkling's ``embed_norm``: ``hf.lookup_norm``, the rows summed over TP before it).
    """
    split_all = [f for f, st in plan.styles.items() if st in SPLIT_STYLES]
    for owner, user in traced.foreign.items():
        fqn = owner.split(" (")[0]
        if plan.styles.get(fqn) is None or plan.styles.get(user) == "per_channel":
            continue  # a ``per_channel`` user gives the parameters it uses local views (``channels.py``)
        if plan.styles.get(user) == "experts" and fqn.startswith(f"{user}."):
            continue  # so does an ``experts`` one, to everything under it (JetMoE's attention calling its MoA)
        if user and not any(f == user or f.startswith(f"{user}.") for f in split_all):
            # nothing split under the user (a mixer kept replicated): it runs on local copies
            plan.styles[user] = "replicate_local"
            for name, module in model.get_submodule(user).named_modules():
                if name and any(True for _ in module.parameters(recurse=False)):
                    plan.styles[f"{user}.{name}"] = "replicate_local"
            continue
        if read_whole(model, plan, fqn, user):
            continue  # kept whole: local views of it while the user runs (Gemma 3n's AltUp, ``direct_reads.py``)
        who = f"{any_block(user) or 'the model'} ({type(model.get_submodule(user)).__name__})"
        raise cannot_split(
            f"{who} uses a parameter of {any_block(owner)} directly, which tensor-parallel styles cannot place yet"
        )
    # the vocabulary styles too: a ``replicate`` parent would place their parameters Replicate first (Reformer's
    # LM head owns a bias of its own around the decoder)
    split = [f for f, st in plan.styles.items() if st in (*SPLIT_STYLES, "embedding", "lm_head")]
    for fqn, style in plan.styles.items():
        if style in ("replicate", "replicate_grad_allreduce") and fqn and any(f.startswith(f"{fqn}.") for f in split):
            if style == "replicate":
                # its own parameters act on whole activations only (the trace checked: a parameter,
                # or a tensor computed from parameters alone, meeting split ones is a violation)
                plan.styles[fqn] = "replicate_own"
                continue
            raise cannot_split(
                f"{any_block(fqn)} ({type(model.get_submodule(fqn)).__name__}) holds parameters of its "
                "own around split layers, which tensor-parallel styles cannot place yet"
            )
        # an input embedding / LM head of several parameterized modules (Inkling 2's): torch's vocabulary
        # styles place only a module's own parameters (found with MoE models, which planned from here on)
        module = model.get_submodule(fqn)
        normed = style == "embedding" and looks_up_rows(module) and lookup_norm(module) is not None  # Inkling's
        if style in ("embedding", "lm_head") and not normed and any("." in n for n, _ in module.named_parameters()):
            raise cannot_split(
                f"{fqn} ({type(module).__name__}), the {style.replace('_', ' ')}, holds parameters in "
                "submodules, which the vocabulary-parallel style cannot place yet"
            )
    places: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            places.setdefault(id(p), []).append(name)
    for names in places.values():
        kinds = {plan.styles[n] for n in names if n in plan.styles}  # unstyled: placed by another owner
        if len(kinds) > 1 and kinds != {"embedding", "lm_head"}:
            raise not_splittable(
                f"a parameter is shared by {' and '.join(names)} with different styles "
                f"({', '.join(sorted(str(k) for k in kinds))})"
            )


def _finish(model: nn.Module, plan: Plan, forced: frozenset[str], reasons: dict[str, str]) -> Plan:
    # a linear the trace saw whole that its experts module splits (JetMoE's kv_proj beside its routed queries)
    forced = frozenset(f for f in forced if plan.styles.get(f) != "per_channel")
    plan.replicated = {f: model_property(model, f) or reasons.get(f, "") for f in sorted(forced)}
    check_vocab_head(model, plan)  # Dory's per-token ``logit_scale`` in its LM head
    split = [f for f, s in plan.styles.items() if s in SPLIT_LINEAR or s == "experts"]  # MoE: experts split too
    if forced and not split:
        first = reasons[min(forced)]
        raise cannot_split(f"no layer of {type(model).__name__} can be split: {first}")
    return plan


def _slice_shared_rows(model: nn.Module, plan: Plan, tp: int) -> None:
    """Fill ``plan.sliced`` (see the module docstring); refuse what cannot be split per rank."""
    geo = plan.geometry.split_sizes
    heads = plan.geometry.heads or 0
    kv = plan.geometry.kv or 0
    if not heads or not plan.attention:
        return  # nothing split per head (attention-free, or every attention block kept replicated)
    d = plan.geometry.head_dim or 0
    replicated = kv < tp
    plan.kv_heads = (kv, 1 if replicated else kv // tp)

    def kv_head(rank: int) -> int:  # the kv head rank's query heads read, when kv < tp
        return rank // (tp // kv)

    norms = [f for f, style in plan.styles.items() if style == "sharded_norm"]
    # k_norm first; a parameter-free norm (Dory's, over attention's output) is none
    norms = [f for f in norms if getattr(model.get_submodule(f), "weight", None) is not None]
    norms = [f for f in norms if model.get_submodule(f).weight.shape[0] == kv * d] or norms
    if replicated and norms:
        valid = [t for t in _valid_tps(geo, plan.geometry.vocab) if kv % t == 0]
        raise ConfigError(
            f"parallel.tp={tp} exceeds the model's num_key_value_heads={kv}, and {norms[0]} normalizes across all "
            f"kv heads, which replicated kv heads cannot do; valid tp values: {', '.join(map(str, valid))}"
        )
    for fqn, style in plan.styles.items():
        module, parent = model.get_submodule(fqn), fqn.rpartition(".")[0]
        if style == "colwise" and replicated and parent in plan.attention and out_features(module) == kv * d:
            siblings = [out_features(m) for _, m in model.get_submodule(parent).named_children() if is_linear(m)]
            if heads * d in siblings:
                plan.sliced[fqn] = [[(kv_head(r) * d, (kv_head(r) + 1) * d)] for r in range(tp)]
        elif style == "packed_colwise":
            parts = plan.parts[fqn]
            kv_part = [replicated and p == kv * d and kv != heads for p in parts]
            whole = plan.whole_parts.get(fqn, [False] * len(parts))  # Mamba-2's B, C at n_groups < tp
            bad = [p for p, rep, w in zip(parts, kv_part, whole) if p % tp and not rep and not w]
            if bad:
                raise ConfigError(f"parallel.tp={tp} does not divide the parts {parts} of fused projection {fqn}")
            if any(kv_part) or any(whole):
                plan.sliced[fqn] = [
                    _packed_rows(parts, kv_part, r, tp, d, kv_head(r) if replicated else 0, whole) for r in range(tp)
                ]
    if replicated:
        owners = {f.rpartition(".")[0] for f in plan.sliced}
        for name in plan.attention:
            module = model.get_submodule(name)
            if name not in owners and any(isinstance(getattr(module, a, None), int) for a in MODULE_KV_COUNT_ATTRS):
                valid = [t for t in _valid_tps(geo, plan.geometry.vocab) if kv % t == 0]
                raise ConfigError(
                    f"parallel.tp={tp} exceeds the model's num_key_value_heads={kv} and {name} "
                    f"({type(module).__name__}) fuses them in a layout shardlm cannot replicate per rank; "
                    f"valid tp values for this model: {', '.join(map(str, valid))}"
                )


def _packed_rows(
    parts: list[int], kv_part: list[bool], rank: int, tp: int, d: int, head: int, whole: list[bool]
) -> list[tuple[int, int]]:
    """Rank's rows of a packed projection: its chunk of every part, its kv head's rows, or a whole part."""
    rows, offset = [], 0
    for size, replicated_kv, held in zip(parts, kv_part, whole):
        if held:
            rows.append((offset, offset + size))
        elif replicated_kv:
            rows.append((offset + head * d, offset + (head + 1) * d))
        else:
            rows.append((offset + rank * size // tp, offset + (rank + 1) * size // tp))
        offset += size
    return rows


def infer_tp_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """``{module_fqn: style}`` for ``model`` at TP degree ``tp`` (empty for tp=1)."""
    return infer_plan(model, tp).styles


def _valid_tps(sizes: dict[str, int], vocab: int | None = None) -> list[int]:
    """TP degrees that divide every size, and divide or are a multiple of the kv head count (a
    rank's query heads must read whole kv heads: with fewer kv heads than tp they are replicated),
    and leave every rank rows of ``vocab`` (``holds_vocab_rows``)."""
    kv = sizes.get("num_key_value_heads")
    rest = [v for k, v in sizes.items() if k != "num_key_value_heads"] or [kv or 1]
    return [
        t
        for t in range(1, min(rest) + 1)
        if all(s % t == 0 for s in rest)
        and (kv is None or kv % t == 0 or t % kv == 0)
        and (vocab is None or holds_vocab_rows(vocab, t))
    ]


def holds_vocab_rows(vocab: int, tp: int) -> bool:
    """Every TP rank holds rows of a ``vocab``-row embedding and columns of the LM head. The vocabulary
    need not divide by tp: it is split in torch's chunks of ``ceil(vocab / tp)`` rows, the last rank
    holding fewer (GPT-2's 50257 at tp=2: 25129 and 25128), as ``Shard(0)`` places any dim (Megatron pads
    instead); only a vocabulary so small that a chunk is left empty is refused."""
    return all(chunk_rows(vocab, tp))


def check_config_geometry(config, tp: int) -> None:
    """Refuse a TP degree the model's shapes cannot be split by, naming the numbers."""
    if tp == 1:
        return
    geo = read_geometry(config)
    present, vocab = geo.split_sizes, geo.vocab
    valid = ", ".join(map(str, _valid_tps(present, vocab)))
    for key, size in present.items():
        if size % tp and key != "num_key_value_heads":
            raise ConfigError(
                f"parallel.tp={tp} does not divide the model's {key}={size}; valid tp values for this model: {valid}"
            )
    kv = present.get("num_key_value_heads")
    if kv is not None and kv % tp and tp % kv:
        raise ConfigError(
            f"parallel.tp={tp} neither divides nor is a multiple of the model's num_key_value_heads={kv} (a rank's "
            f"query heads would read parts of two kv heads); valid tp values for this model: {valid}"
        )
    if vocab is not None and not holds_vocab_rows(vocab, tp):
        raise ConfigError(
            f"parallel.tp={tp} leaves a rank no row of the model's vocab_size={vocab} (split in chunks of "
            f"{-(-vocab // tp)} rows); valid tp values for this model: {valid}"
        )


def check_geometry(model_path: str, tp: int) -> None:
    """Read ``config.json`` of ``model_path`` and check it against ``tp`` (before spawning)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise ConfigError(f"model: cannot read '{model_path}/config.json': {str(exc).splitlines()[0]}") from None
    check_config_geometry(config, tp)
