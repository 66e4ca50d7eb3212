"""Checks of a run against its model, before any process is spawned.

``config`` checks values alone; what only the model can answer is checked here, in the launcher
process, so a run that cannot work ends with one ``error:`` line instead of a failure in every
rank: the head/vocabulary geometry against ``parallel.tp``, a router loss the trainer does not add
(``output_router_logits``), LayerDrop under more than one rank, the experts ``parallel.ep`` divides,
the traced TP plan (refusals such as fused kv groups that a tp cannot split), the LoRA targets,
the model's weights (their names through transformers' conversion rules, ``parallel/published.py``)
and the checkpoint ``train.resume`` names.
"""

from __future__ import annotations

from shardlm.checkpoint.manager import precheck_resume
from shardlm.config import Config
from shardlm.parallel.autotp import check_geometry, infer_plan
from shardlm.parallel.build import build_meta_model, has_weights
from shardlm.parallel.dropout import check_layerdrop
from shardlm.parallel.ep import check_ep
from shardlm.parallel.experts import check_router_aux_loss
from shardlm.parallel.lora import check_lora
from shardlm.parallel.published import check as check_weights


def check_run(cfg: Config) -> None:
    """Raise ``ConfigError`` for the first thing about ``cfg``'s model that cannot work."""
    p = cfg.parallel
    check_geometry(cfg.model, p.tp)
    traced, weights = p.tp > 1 or cfg.lora is not None, has_weights(cfg.model)
    model = build_meta_model(cfg.model) if traced or weights or p.ep > 1 else None  # one (LoRA adapts it last)
    if p.ep > 1:  # the model has experts, as many as ep divides
        check_ep(model, p.ep)
    if weights:  # the checkpoint's names, converted by transformers' rules, cover the model
        check_weights(cfg.model, model)
    check_router_aux_loss(cfg.model)
    if p.world_size > 1:
        check_layerdrop(cfg.model)
    if traced:  # what only the traced plan can refuse (Falcon's fused kv groups)
        plan = infer_plan(model, p.tp)
        if cfg.lora is not None:
            check_lora(cfg.lora, model, plan)
    precheck_resume(cfg)
