"""Checks of a run against its model, before any process is spawned.

``config`` checks values alone; what only the model can answer is checked here, in the launcher
process, so a run that cannot work ends with one ``error:`` line instead of a failure in every
rank: the head/vocabulary geometry against ``parallel.tp``, a router load-balancing loss the trainer
cannot compute over the global batch (``train/router_loss.py``), LayerDrop under more than one rank,
the experts ``parallel.ep`` divides, the pipeline stages ``parallel.pp`` cuts the model into,
the attention ``parallel.cp`` splits,
the traced TP plan (refusals such as fused kv groups that a tp cannot split, or a split Mamba mixer
that would run a fused kernel reading its weights itself), the LoRA targets,
the model's weights (their names through transformers' conversion rules, ``parallel/weights/published.py``),
``lora.modules_to_save``, the free space under ``train.output_dir`` against a checkpoint's size,
and the checkpoint ``train.resume`` names (its bytes against its manifest, its model's fingerprint).
``check_data`` then checks ``data.seq_len`` against the model's positions, loads the tokenizer and
builds the data sets here (the ranks load them from the cache): the tokenizer's ids against the
vocabulary, a chat template where chat rows need one, data that yields no usable row and ids out
of range answer the same at every layout. Document packing the model cannot keep apart
(``train/document_mask.py``) is refused last of the model's checks.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

from torch import nn

from shardlm.checkpoint.manager import precheck_resume
from shardlm.config import Config
from shardlm.config.paths import check_tokenizer_path, nearest_existing
from shardlm.data.dataset import build_dataset
from shardlm.data.fit import check_ids, check_seq_len, check_tokenizer, load_tokenizer, model_config, vocab_size
from shardlm.distributed.mesh import device_type
from shardlm.errors import ConfigError
from shardlm.parallel.infer.autotp import check_geometry, infer_plan
from shardlm.parallel.infer.channels import check_fused_kernels
from shardlm.parallel.infer.stages import stage_layout
from shardlm.parallel.model.meta import build_meta_model
from shardlm.parallel.plan.local_geometry import random_blocks_length, random_blocks_refusal
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.sequence import sequence_refusal
from shardlm.parallel.runtime.context import check_context_parallel
from shardlm.parallel.runtime.dropout import check_layerdrop
from shardlm.parallel.runtime.ep import check_ep, check_ep_lora
from shardlm.parallel.runtime.lora import check_lora
from shardlm.parallel.weights.fill import has_weights
from shardlm.parallel.weights.published import check as check_weights
from shardlm.train import router_loss
from shardlm.train.document_mask import check_packing
from shardlm.train.trainer import check_activation_checkpointing


def check_run(cfg: Config) -> str | None:
    """Raise ``ConfigError`` for the first thing about ``cfg``'s model that cannot work; returns the
    checkpoint ``train.resume`` resumes from, verified against its manifest (None: a fresh start)."""
    p = cfg.parallel
    check_geometry(cfg.model, p.tp)
    traced, weights, router = p.tp > 1 or cfg.lora is not None, has_weights(cfg.model), router_loss.requested(cfg.model)
    packed = cfg.data.packing and cfg.data.packing_strategy == "bfd"
    saves = cfg.train.save_steps > 0 and cfg.lora is None  # a full checkpoint: its size against the free space
    ckpt = cfg.train.gradient_checkpointing
    # one meta model for every check that needs it (LoRA adapts it last)
    needs_model = traced or weights or router or saves or ckpt or packed or p.ep > 1 or p.pp > 1 or p.cp > 1
    model = build_meta_model(cfg.model) if needs_model else None
    # attention the cp ranks can split, heads the Ulysses variant can (parallel/runtime/context.py)
    check_context_parallel(model, p.cp, p.cp_attention, p.tp)
    if ckpt:  # else every rank refuses it when the Trainer is built (exit 1 at tp > 1)
        check_activation_checkpointing(model)
    if p.ep > 1:  # the model has experts, as many as ep divides
        check_ep(model, p.ep)
    if p.pp > 1:  # as many blocks as stages, and a forward the stages can be cut from (parallel/infer/stages.py)
        stage_layout(model, p.pp * p.pp_stages_per_rank)
    if weights:  # the checkpoint's names, converted by transformers' rules, cover the model
        check_weights(cfg.model, model)
    if router:  # the load-balancing loss over the global batch
        router_loss.check(model, cfg.train.gradient_accumulation_steps)
        # pp: each micro-batch's backward needs the assignment counts of every block on every stage over the
        # whole global batch (train/router_loss.py), known only after the step's last forward, which the
        # schedules (1F1B) run after the first backwards, as with gradient accumulation; cp: not tested yet
        fix = "set output_router_logits false in the model's config.json or"
        if p.pp > 1:
            raise ConfigError(
                f"the router's load-balancing loss (output_router_logits) with parallel.pp={p.pp} needs the step's "
                f"whole expert counts before {p.pp_schedule}'s first backward, which runs before the step's last "
                f"forward; {fix} parallel.pp: 1"
            )
        if p.cp > 1:
            why = "the router's load-balancing loss (output_router_logits) with parallel.cp is not supported yet"
            raise ConfigError(f"{why}; {fix} parallel.cp: 1")
    if p.world_size > 1:
        check_layerdrop(cfg.model)
    if traced:  # what only the traced plan can refuse (Falcon's fused kv groups, fused mixer kernels on GPU)
        plan = infer_plan(model, p.tp)
        if p.tp > 1:
            check_random_blocks(model, cfg.data.seq_len)
        if p.tp > 1 and device_type() == "cuda":
            check_fused_kernels(model, plan, p.tp)
        if p.sequence_parallel:
            check_sequence_parallel(cfg, model, plan)
        if cfg.lora is not None:
            check_modules_to_save(cfg.lora.modules_to_save, model)
            check_lora(cfg.lora, model, plan)
            if p.ep > 1:
                check_ep_lora(model)
    if packed:  # last of the model's checks: another refusal names its own key first
        check_packing(cfg, model)
    if saves:
        check_disk_space(cfg, model)
    return precheck_resume(cfg)


def check_sequence_parallel(cfg: Config, model: nn.Module, plan: Plan) -> None:
    """``parallel.sequence_parallel`` on a plan it can run (``plan.sequence.sequence_refusal``)."""
    why = sequence_refusal(model, plan)
    if why is not None:
        raise ConfigError(
            f"parallel.sequence_parallel=true cannot run this model: {why}; set parallel.sequence_parallel=false"
        )


def check_random_blocks(model: nn.Module, seq_len: int) -> None:
    """At tp > 1, no attention that would draw random key blocks per head at ``data.seq_len`` (BigBird's
    block-sparse attention above its full-attention length; ``plan.local_geometry.random_blocks_length``)."""
    for name, module in model.named_modules():
        length = random_blocks_length(module)
        if length is not None and seq_len > length:
            raise ConfigError(f"data.seq_len={seq_len}: {random_blocks_refusal(name, module)}")


def check_modules_to_save(names: list | None, model: nn.Module) -> None:
    """Each ``lora.modules_to_save`` entry ends some module's name (peft's rule: ``key.endswith``);
    peft ignores one that matches nothing, so the user would train without what they asked for."""
    fqns = [fqn for fqn, _ in model.named_modules() if fqn]
    for name in names or []:
        if not any(fqn.endswith(str(name)) for fqn in fqns):
            leaves = sorted({fqn.rsplit(".", 1)[-1] for fqn in fqns if not any(c.isdigit() for c in fqn)})
            raise ConfigError(
                f"lora.modules_to_save: no module of the model is named '{name}' (peft matches the end of a "
                f"module's name); modules outside the blocks: {', '.join(leaves[:20])}"
            )


def checkpoint_bytes(cfg: Config, model: nn.Module) -> int:
    """Bytes of one full checkpoint: fp32 parameters and the optimizer's fp32 states per parameter
    (AdamW two, SGD with momentum one); tied parameters once."""
    numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    t = cfg.train
    states = 2 if t.optim == "adamw" else int(t.sgd_momentum > 0)
    return 4 * numel * (1 + states)


def check_disk_space(cfg: Config, model: nn.Module) -> None:
    """The filesystem of ``train.output_dir`` holds one more checkpoint (a save writes the new one
    before pruning old ones), so a run does not fail at its first save after hours of training."""
    need, base = checkpoint_bytes(cfg, model), nearest_existing(cfg.train.output_dir)
    free = shutil.disk_usage(base).free
    if free < need:
        gib = 2**30
        raise ConfigError(
            f"train.output_dir: a checkpoint needs about {need / gib:.2f} GiB but '{base}' has {free / gib:.2f} GiB "
            "free; free space, choose another train.output_dir, or set train.save_steps: 0"
        )


def check_data(cfg: Config) -> None:
    """Load the tokenizer and build the data sets in the launcher, as every rank would: what the
    data or tokenizer cannot do (``data.seq_len`` beyond the model's positions included) is one
    ``error:`` line here, the same at every layout, and the ranks then load the cached samples.
    Only the command runs this: the library's users may hand the trainer samples of their own."""
    check_tokenizer_path(cfg.model, cfg.tokenizer)  # the library's users may bring samples without one
    where = cfg.tokenizer or cfg.model
    try:
        tokenizer = load_tokenizer(cfg)
    except Exception as exc:  # noqa: BLE001 - whatever transformers says about the user's files
        detail = " ".join(str(exc).split())[:200]
        why = f"tokenizer: cannot load a tokenizer from '{where}' ({type(exc).__name__}: {detail})"
        raise ConfigError(why) from None
    config = model_config(cfg.model)
    check_seq_len(config, cfg.data.seq_len)
    check_tokenizer(tokenizer, config, where)
    vocab = vocab_size(config)
    for key, data in (("data.path", cfg.data), ("eval.path", replace(cfg.data, path=cfg.eval.path))):
        if data.path:
            ds = build_dataset(data, tokenizer, key=key)
            if vocab is not None:
                check_ids(ds.input_ids, vocab, key)
