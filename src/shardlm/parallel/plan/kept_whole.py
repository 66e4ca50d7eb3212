"""What a plan stores whole on every TP rank, and why, with the attention's parameter bytes per rank
next to 1/tp: the "kept whole" column of the compatibility matrix (``scripts/matrix.py``).

Norms, routers and the biases added after a row-parallel all-reduce are whole in every model and
not listed; listed are what TP could have split and did not: sub-blocks kept replicated (with the
reason the trace gave), projections stored whole of which each rank computes its rows (kv heads
fewer than tp, MQA's one k/v head, Mamba-2's B and C at fewer groups than tp, MLA's latents),
per-channel parameters whose channels ranks share, parameters of one value broadcast over the
split heads (DiffLlama's lambdas) or of a per-head table each rank reads its heads' rows of (CPM-Ant's
position bias), the parameters of an attention that holds no linear layer, by ``einsum``, where the trace did
not split them by heads (XLNet's, split: ``infer/head_einsums.py``), and
parameters another module's forward reads directly around split layers (``Plan.direct_reads``: Gemma 3n's
AltUp coefficients), and modules whose forward never runs on text rows (``Plan.unrun``: a decoder-only class's
cross-attention, without encoder states, where it is not split like its self-attention (``infer/unrun.py``); a
multimodal checkpoint's vision or audio tower): no trace saw them.
"""

from __future__ import annotations

import re

import torch.nn as nn

from shardlm.parallel.model.hf import is_linear, tower_parameters
from shardlm.parallel.plan.channels import param_rows
from shardlm.parallel.plan.describe import describe_plan
from shardlm.parallel.plan.plan import Plan

# transformers' attention classes: ``LlamaAttention``, ``GPT2Attention``, ``GPTNeoFlashAttention2``; not a class
# holding more than an attention (Jamba's ``JambaAttentionDecoderLayer``, SigLIP's ``...AttentionPoolingHead``)
_ATTENTION = re.compile(r"(Attention|Attn)\d*$")
_CROSS = re.compile(r"encoder_attn|cross", re.IGNORECASE)  # cross-attention modules: BART's, Whisper's ``encoder_attn``


# DeepSeek-V4's attention (``infer/shared_kv.py``): the key=value head and the compressor appending to it
_SHARED_KV = "the one shared key=value head and its compressed windows, read by every query head"


def _in_shared_kv(plan: Plan, fqn: str) -> bool:
    return any(fqn.startswith(f"{a}.") for a in plan.shared_kv)


def _any_block(fqn: str) -> str:
    return re.sub(r"(?<=[A-Za-z_])\.\d+(?=\.|$)", ".*", fqn)


def kept_whole(plan: Plan, model: nn.Module | None = None) -> list[str]:
    """``module: why`` for each kind of thing stored whole on every rank (see the module docstring),
    one entry for every block alike; with ``model``, also the attentions of no linear layer (``_no_linears``)."""
    found: dict[str, None] = dict.fromkeys(_no_linears(model, plan) if model is not None else [])
    replicated: dict[str, dict[str, None]] = {}  # why -> the modules kept replicated for it
    for fqn, why in plan.replicated.items():
        replicated.setdefault(why, {})[_any_block(fqn)] = None
    for why, fqns in replicated.items():
        found[f"{', '.join(fqns)}: replicated ({why[:100]})"] = None
    latents = set(plan.latent_readers.values())
    kv, _ = plan.kv_heads
    for fqn in plan.sliced:
        if _in_shared_kv(plan, fqn) and not fqn.endswith(".q_a_proj"):
            why = _SHARED_KV
        elif fqn in latents:
            why = "a low-rank latent (MLA), read whole by every head"
        elif fqn.rpartition(".")[0] in plan.indexers:  # Qwen4-Exp's QSA: [query heads | key head] fused
            why = "the indexer's one key head, fused with its query heads: each rank computes its heads and the key"
        elif any(plan.whole_parts.get(fqn, [])):
            why = "parts every rank needs whole (groups fewer than tp)"
        else:
            why = f"{kv} kv head(s) for tp ranks: each computes its query rows and its kv head"
        found[f"{_any_block(fqn)}: stored whole ({why})"] = None
    for fqn, params in plan.channels.items():
        for pname in params:
            if param_rows(plan, fqn, pname) is not None:
                found[f"{_any_block(fqn)}.{pname}: stored whole (its channels shared by ranks)"] = None
    direct: dict[str, dict[str, None]] = {}  # why -> the modules another module's forward reads directly
    for fqn, (_, why) in plan.direct_reads.items():
        if fqn not in plan.replicated:  # listed above (Gemma 3n's prediction_coefs, a latent to the trace)
            direct.setdefault(why, {})[_any_block(fqn)] = None
    for why, fqns in direct.items():
        found[f"{', '.join(fqns)}: stored whole ({why[:100]})"] = None
    # a split attention's own (DiffLlama's lambdas), or a table a module outside it makes a per-head tensor of
    # (CPM-Ant's position bias, ``infer/head_inputs.py``)
    shared = [f for f in plan.partial_grads if _in_shared_kv(plan, f)]
    if shared:
        found[f"{', '.join(dict.fromkeys(_any_block(f) for f in shared))}: stored whole ({_SHARED_KV})"] = None
    own = [fqn for fqn in plan.partial_grads if fqn.rpartition(".")[0] in plan.attention]
    for fqns, why in (
        (own, "one value broadcast over the split heads"),
        (
            [f for f in plan.partial_grads if f not in {*own, *shared}],
            "a per-head table: each rank reads its heads' rows",
        ),
    ):
        names = dict.fromkeys(_any_block(fqn) for fqn in fqns)
        if names:
            found[f"{', '.join(names)}: stored whole ({why})"] = None
    found.update(dict.fromkeys(_unrun(plan, model)))
    return list(found)


def _unrun(plan: Plan, model: nn.Module | None) -> list[str]:
    """``Plan.unrun`` grouped by why it never runs on text rows: the tower parameters (``hf.tower_parameters``,
    with ``model``), cross-attention (by name, ``_CROSS``), else only that the trace never ran it."""
    towers = set(tower_parameters(model)) if model is not None else set()
    groups: dict[str, dict[str, None]] = {}
    for fqn in plan.unrun:
        under = [s for f, s in plan.styles.items() if f == fqn or f.startswith(f"{fqn}.")]
        if any(s not in ("replicate", "replicate_local") for s in under):
            continue  # placed without the trace (MoE experts, probed: ``experts.py``)
        module = model.get_submodule(fqn) if model is not None else None
        params = [f"{fqn}.{n}" for n, _ in module.named_parameters()] if module is not None else []
        if module is not None and all(p.dim() == 1 for p in module.parameters()):
            continue  # a norm (the cross-attention's own): norms are not listed
        if params and all(p in towers for p in params):
            why = "a vision/audio tower: not run on text rows; frozen unless train.train_vision_tower"
        elif _CROSS.search(fqn.rpartition(".")[2]):
            why = "cross-attention: never run without encoder states (text rows)"
        else:  # Phi-4-multimodal's image/audio embedders, inside its language model
            why = "never run on text rows: the trace never reached it; not a tower, so not frozen"
        groups.setdefault(why, {})[f"{_any_block(fqn)}.*"] = None
    return [f"{', '.join(fqns)}: stored whole ({why})" for why, fqns in groups.items()]


def _no_linears(model: nn.Module, plan: Plan) -> list[str]:
    """The attention modules (``_tops``) that hold no linear layer, computing on per-head parameters of
    their own, which the plan did not split (``Plan.head_einsums``: XLNet's relative attention, its
    ``einsum`` of q, k, v, o, r [d_model, heads, d_head], is split by heads, ``infer/head_einsums.py``):
    one entry per kind. A parameter of [heads, head_dim] says per-head (not Inkling's attention residuals'
    queries)."""
    found: dict[str, None] = {}
    heads, width = plan.geometry.heads, plan.geometry.head_dim
    for fqn in _tops(model):
        module = model.get_submodule(fqn)
        own = [n for n, _ in module.named_parameters(recurse=False)]
        per_head = any(heads in p.shape and width in p.shape for p in module.parameters(recurse=False))
        if own and per_head and fqn not in plan.head_einsums and not any(is_linear(m) for m in module.modules()):
            names = ", ".join(own)
            why = "einsums of per-head parameters the trace did not split by heads"
            found[f"{_any_block(fqn)}.{{{names}}}: stored whole ({why})"] = None
    return list(found)


def _tops(model: nn.Module) -> list[str]:
    """The outermost modules of an attention class (``_ATTENTION``)."""
    tops: list[str] = []
    for name, module in model.named_modules():
        if _ATTENTION.search(type(module).__name__) and not any(name.startswith(f"{t}.") for t in tops):
            tops.append(name)
    return tops


def attention_bytes(model: nn.Module, plan: Plan, tp: int, ran: bool = False) -> tuple[int, int]:
    """(fp32 bytes of the attention modules' parameters on one rank, in the whole model): the
    outermost modules of an attention class (``_ATTENTION``), split or kept whole; with ``ran``, only those
    the traced text forward ran (not a tower's, nor a cross-attention kept whole: ``Plan.unrun``)."""
    tops = [t for t in _tops(model) if not ran or not any(t == u or t.startswith(f"{u}.") for u in plan.unrun)]
    rows = [
        r
        for r in describe_plan(model, plan, tp)
        if any(r["module"] == t or r["module"].startswith(f"{t}.") for t in tops)
    ]
    return sum(r["bytes_per_rank"] for r in rows), sum(r["bytes_global"] for r in rows)
