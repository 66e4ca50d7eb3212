"""Checks of a run against its model, before any process is spawned.

``config`` checks values alone; what only the model can answer is checked here, in the launcher
process, so a run that cannot work ends with one ``error:`` line instead of a failure in every
rank: the head/vocabulary geometry against ``parallel.tp``, a router load-balancing loss the trainer
cannot compute over the global batch (``train/router_loss.py``), LayerDrop under more than one rank,
the experts ``parallel.ep`` divides,
the traced TP plan (refusals such as fused kv groups that a tp cannot split, or a split Mamba mixer
that would run a fused kernel reading its weights itself), the LoRA targets,
the model's weights (their names through transformers' conversion rules, ``parallel/published.py``),
document packing the model cannot keep apart (``train/document_mask.py``)
and the checkpoint ``train.resume`` names.
"""

from __future__ import annotations

from shardlm.checkpoint.manager import precheck_resume
from shardlm.config import Config
from shardlm.distributed.mesh import device_type
from shardlm.parallel.autotp import check_geometry, infer_plan
from shardlm.parallel.build import build_meta_model, has_weights
from shardlm.parallel.channels import check_fused_kernels
from shardlm.parallel.dropout import check_layerdrop
from shardlm.parallel.ep import check_ep, check_ep_lora
from shardlm.parallel.lora import check_lora
from shardlm.parallel.published import check as check_weights
from shardlm.train import router_loss
from shardlm.train.document_mask import check_packing


def check_run(cfg: Config) -> None:
    """Raise ``ConfigError`` for the first thing about ``cfg``'s model that cannot work."""
    p = cfg.parallel
    check_geometry(cfg.model, p.tp)
    traced, weights, router = p.tp > 1 or cfg.lora is not None, has_weights(cfg.model), router_loss.requested(cfg.model)
    packed = cfg.data.packing and cfg.data.packing_strategy == "bfd"
    # one meta model for every check that needs it (LoRA adapts it last)
    model = build_meta_model(cfg.model) if traced or weights or router or packed or p.ep > 1 else None
    if p.ep > 1:  # the model has experts, as many as ep divides
        check_ep(model, p.ep)
    if weights:  # the checkpoint's names, converted by transformers' rules, cover the model
        check_weights(cfg.model, model)
    if router:  # the load-balancing loss over the global batch
        router_loss.check(model, cfg.train.gradient_accumulation_steps)
    if p.world_size > 1:
        check_layerdrop(cfg.model)
    if traced:  # what only the traced plan can refuse (Falcon's fused kv groups, fused mixer kernels on GPU)
        plan = infer_plan(model, p.tp)
        if p.tp > 1 and device_type() == "cuda":
            check_fused_kernels(model, plan, p.tp)
        if cfg.lora is not None:
            check_lora(cfg.lora, model, plan)
            if p.ep > 1:
                check_ep_lora(model)
    if packed:  # last of the model's checks: another refusal names its own key first
        check_packing(cfg, model)
    precheck_resume(cfg)
