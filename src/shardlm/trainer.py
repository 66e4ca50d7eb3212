"""The training loop: micro-steps, token-weighted loss, global clipping, optimizer step, logging.

One optimizer step:
  1. every dp rank takes its micro-batches of the global batch (``data.py``);
  2. one all-reduce counts the labelled tokens of the whole global batch;
  3. each micro-step backpropagates ``sum of token losses / global count`` (``loss.py``);
     FSDP2 sums gradients across dp ranks;
  4. the global gradient norm is computed over every placement and clipped (``clip.py``);
  5. optimizer and LR scheduler step; rank 0 logs the step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardlm import checkpoint
from shardlm.clip import clip_grad_norm_
from shardlm.config import Config
from shardlm.data import GlobalBatchOrder, TokenDataset, build_dataset, micro_batch
from shardlm.loss import as_local, loss_context, token_loss_sum
from shardlm.mesh import Mesh, build_mesh, init_distributed
from shardlm.parallelize import parallelize
from shardlm.styles import sum_tp_partial_grads

log = logging.getLogger("shardlm")


def print0(*args) -> None:
    """Print on global rank 0 only (the one place user-facing progress is printed)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def _setup_rank_log(output_dir: str) -> None:
    rank = dist.get_rank()
    os.makedirs(os.path.join(output_dir, "logs"), exist_ok=True)
    handler = logging.FileHandler(os.path.join(output_dir, "logs", f"rank{rank}.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.handlers = [handler]
    log.setLevel(logging.INFO)


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; no weight decay on 1-D parameters (norms, biases)."""
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config):
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup"}.get(cfg.train.lr_scheduler_type, cfg.train.lr_scheduler_type)
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.train.warmup_steps, num_training_steps=cfg.train.max_steps)


@dataclass
class Trainer:
    """Trains a parallelized model on a token dataset with the settings of ``config``."""

    model: nn.Module
    config: Config
    dataset: TokenDataset
    mesh: Mesh
    history: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.optimizer = build_optimizer(self.model, self.config)
        self.scheduler = build_scheduler(self.optimizer, self.config)
        self.order = GlobalBatchOrder(len(self.dataset), self.config.global_batch_size, self.config.train.seed)
        self.step = 0

    def _all_reduce_dp(self, value: torch.Tensor) -> torch.Tensor:
        if self.mesh.parallel.dp_size > 1:
            dist.all_reduce(value, group=self.mesh.dp_group)
        return value

    def train_step(self) -> dict:
        t, p = self.config.train, self.mesh.parallel
        start = time.perf_counter()
        device = self.mesh.device
        batches = [
            micro_batch(self.dataset, self.order, self.step, m, self.mesh.dp_rank, p.dp_size, t.per_device_train_batch_size).to(device)
            for m in range(t.gradient_accumulation_steps)
        ]
        count = self._all_reduce_dp(torch.stack([(b.labels != -100).sum() for b in batches]).sum().float())
        denom = max(float(count), 1.0)
        loss_sum = torch.zeros((), device=device)
        for batch in batches:
            logits = self.model(input_ids=batch.input_ids).logits
            with loss_context(isinstance(logits, DTensor)):
                micro_loss = token_loss_sum(logits, batch.labels)
                (micro_loss / denom).backward()
            loss_sum += as_local(micro_loss).detach()
        loss = self._all_reduce_dp(loss_sum) / denom
        partial = getattr(self.model, "shardlm_tp_partial_grads", [])
        if partial:
            sum_tp_partial_grads(self.model, partial, self.mesh.tp.get_group())
        grad_norm = clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = int(self._all_reduce_dp(torch.tensor(sum(b.input_ids.numel() for b in batches), device=device)))
        return {
            "step": self.step,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "learning_rate": lr,
            "tokens_per_second": tokens / elapsed,
            "step_time_s": elapsed,
        }

    def train(self) -> list[dict]:
        t = self.config.train
        is_main = dist.get_rank() == 0
        metrics_path = os.path.join(t.output_dir, "metrics.jsonl")
        resumed = checkpoint.maybe_resume(self)  # checkpoint: model, optimizer, scheduler, RNG, step
        if is_main:
            os.makedirs(t.output_dir, exist_ok=True)
            if not resumed:  # a resumed run appends to its metrics
                open(metrics_path, "w").close()
        while self.step < t.max_steps:
            record = self.train_step()
            log.info(json.dumps(record))
            if self.step % t.logging_steps == 0 or self.step == t.max_steps:
                self.history.append(record)
                if is_main:
                    with open(metrics_path, "a") as fh:
                        fh.write(json.dumps(record) + "\n")
                    print0(
                        f"step {record['step']:>5}/{t.max_steps}  loss {record['loss']:.4f}  "
                        f"grad_norm {record['grad_norm']:.4f}  lr {record['learning_rate']:.2e}  "
                        f"tok/s {record['tokens_per_second']:.0f}"
                    )
            if checkpoint.should_save(self.step, t.save_steps, t.max_steps):
                checkpoint.save_checkpoint(self)
        return self.history


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)


def run(cfg: Config) -> list[dict]:
    """One rank's whole job: join the world, build everything, train. Returns the logged records."""
    init_distributed()
    mesh = build_mesh(cfg.parallel)
    _setup_rank_log(cfg.train.output_dir)
    log.info("rank %d of %d, layout %s", dist.get_rank(), dist.get_world_size(), cfg.parallel)
    dataset = build_dataset(cfg.data, load_tokenizer(cfg))
    print0(f"data: {len(dataset)} samples of {cfg.data.seq_len} tokens ({dataset.skipped_rows} rows skipped)")
    model = parallelize(cfg.model, mesh, seed=cfg.train.seed)
    history = Trainer(model, cfg, dataset, mesh).train()
    return history
