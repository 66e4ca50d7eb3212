"""Tiny models, tiny data, a plain one-process reference, and real multi-process runs.

``run_ranks`` goes through ``shardlm.launch.spawn``, the launcher users' runs take.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from families import VOCAB

from shardlm.config import Config, ParallelConfig, TrainConfig
from shardlm.data import GlobalBatchOrder, TokenDataset
from shardlm.launch import spawn

SEQ = 16


def tiny_config(family: str = "llama", **overrides):
    """A random-init config of ``family`` small enough for 2-core CI (the shapes live in families.py)."""
    from families import family_config

    return family_config(family, **{"max_position_embeddings": 64, **overrides})


def write_model_dir(path: str, family: str = "llama", **overrides) -> str:
    os.makedirs(path, exist_ok=True)
    tiny_config(family, **overrides).save_pretrained(path)
    return path


def token_dataset(n: int = 24, seq: int = SEQ, seed: int = 1) -> TokenDataset:
    """Random tokens with padding-like IGNORE labels, including wholly ignored samples."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
    labels = ids[:, 1:].clone()
    for i in range(n):
        pad = int(torch.randint(0, seq // 2, (1,), generator=g))
        if pad:
            labels[i, -pad:] = -100
    labels[5] = -100
    labels[11] = -100
    return TokenDataset(ids[:, :-1].clone(), labels)


def train_config(model_path: str, layout: dict, per_device: int, accum: int, steps: int = 5, **train) -> Config:
    t = dict(
        output_dir=os.path.join(os.path.dirname(model_path), "out"),
        max_steps=steps,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accum,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        warmup_steps=1,
        lr_scheduler_type="cosine",
    )
    t.update(train)
    return Config(model=model_path, parallel=ParallelConfig(**layout), train=TrainConfig(**t))


def shardlm_losses(model_paths: list[str], layout: dict, per_device: int, accum: int, steps: int = 5) -> dict:
    """Rank body: train each model with shardlm's API on this rank's layout; (loss, grad_norm) per step."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    out = {}
    for path in model_paths:
        cfg = train_config(path, layout, per_device, accum, steps)
        mesh = build_mesh(cfg.parallel)
        model = parallelize(path, mesh, seed=cfg.train.seed)
        history = Trainer(model, cfg, token_dataset(), mesh).train()
        out[path] = [(h["loss"], h["grad_norm"]) for h in history]
    return out


def run_ranks(fn, world_size: int, *args):
    """Run ``fn(*args)`` on ``world_size`` real processes (gloo, localhost); rank 0's result."""
    return spawn(fn, world_size, *args)[0]


def plain_reference(
    model_path: str, global_batch: int, steps: int = 5, seed: int = 0, optimizer=None, wrap=None, dropout=False
) -> list[tuple[float, float]]:
    """One process, no shardlm training code: transformers model (its seeded init values from
    ``shardlm.parallelize.reference_model``, block by block), mean F.cross_entropy over the
    whole global batch, torch's clip_grad_norm_, AdamW (or ``optimizer(groups, train_cfg)``)
    and the HF scheduler. ``wrap(model)``: e.g. peft's ``PeftModel.from_pretrained``; only the
    parameters that then require grad train. ``dropout``: the model's dropout as shardlm draws it
    (``shardlm.dropout``, keyed by seed, step and the sample's position in the global batch);
    otherwise torch's own (use it only with dropout 0)."""
    from contextlib import nullcontext

    from transformers import get_scheduler

    from shardlm.dropout import DeterministicDropout, DropoutKey, lora_dropout_sites
    from shardlm.parallelize import reference_model

    cfg = train_config(model_path, {}, global_batch, 1, steps)
    t = cfg.train
    model = reference_model(model_path, seed)  # a plain transformers model with shardlm's seeded values
    if wrap is not None:
        model = wrap(model)
    if dropout:
        lora_dropout_sites(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if optimizer is not None:
        opt = optimizer(groups, t)
    else:
        opt = torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon)
    sched = get_scheduler(t.lr_scheduler_type, opt, num_warmup_steps=t.warmup_steps, num_training_steps=steps)
    data = token_dataset()
    order = GlobalBatchOrder(len(data), global_batch, t.seed)
    out = []
    for step in range(steps):
        idx = torch.tensor(order.indices(step))
        key = DropoutKey(t.seed, step, torch.arange(global_batch))
        with DeterministicDropout(key) if dropout else nullcontext():
            logits = model(input_ids=data.input_ids[idx]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), data.labels[idx].flatten(), ignore_index=-100)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


def assert_parity(got: list, ref: list, loss_rtol: float = 1e-5, norm_rtol: float = 1e-4, label: str = "") -> None:
    assert len(got) == len(ref), (label, len(got), len(ref))
    for step, ((loss, norm), (rloss, rnorm)) in enumerate(zip(got, ref), start=1):
        assert math.isfinite(loss) and math.isfinite(norm), label
        assert abs(loss - rloss) <= loss_rtol * abs(rloss), f"{label} step {step}: loss {loss} vs reference {rloss}"
        assert abs(norm - rnorm) <= norm_rtol * abs(rnorm), f"{label} step {step}: grad_norm {norm} vs {rnorm}"
