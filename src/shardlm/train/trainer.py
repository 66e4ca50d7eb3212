"""The training loop: micro-steps, token-weighted loss, global clipping, optimizer step, eval, logging.

One optimizer step:
  1. every dp rank takes its micro-batches of the global batch (``data/dataset.py``); on the first step
     and every logging step the TP ranks of each group compare a checksum of their batches, since
     a TP group computing on different inputs trains garbage without any error (after the first
     two steps' and every logging step's update they compare their replicated parameters too);
  2. one all-reduce counts the labelled tokens of the whole global batch;
  3. each micro-step backpropagates ``sum of token losses / global count`` (``train/loss.py``);
     FSDP2 sums gradients across dp ranks;
  4. the global gradient norm is computed over every placement and clipped (``distributed/clip.py``);
  5. optimizer and LR scheduler step (``train/optim.py``); rank 0 logs the step (``train/metrics.py``).

Mixed precision (``train.bf16``): the forward and backward compute in bf16 while the master
weights, their gradients and the optimizer state stay fp32 and the loss is computed in fp32
(``train/loss.py`` upcasts the logits). With FSDP (dp > 1) the model is built with FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (``mixed_precision_policy``): FSDP
all-gathers bf16 copies of the fp32 shards and reduce-scatters gradients in fp32. Without FSDP
(TP only, or one process) the forward runs under ``torch.autocast(device, bf16)``: autocast sits
above DTensor in the dispatcher, so each matmul casts its (DTensor) weight to bf16 and its
backward casts the gradient back to the fp32 parameter's dtype; nothing is downcast in place.

Activation checkpointing (``train.gradient_checkpointing``) uses transformers' own per-layer
checkpointing (``GradientCheckpointingLayer``, non-reentrant ``torch.utils.checkpoint``): it wraps
each decoder block's ``forward``, not its ``__call__``, so FSDP2's hooks on the block stay outside
the recomputed region, and module FQNs do not change (checkpoints, plans and TP bookkeeping keep
working). The recompute replays the TP styles' hooks, so it produces the same numbers.

Dropout (``parallel/runtime/dropout.py``): each micro-step's forward runs under ``DeterministicDropout``, whose
masks are a hash of (seed, step, call site, the element's position in the global batch and in
the unsharded tensor): TP ranks agree, dp ranks differ, every layout equals one process, and the
recompute of a checkpointed block redraws the same masks. A model without dropout (p = 0
everywhere) runs without the mode after the first step.

Evaluation (``eval``, ``train/evaluation.py``): token-weighted loss over the eval set in file
order, sharded over dp like training, under ``torch.no_grad`` and ``model.eval()``; logged as
``eval_loss`` and ``eval_ppl``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from shardlm.checkpoint import manager as checkpoint
from shardlm.checkpoint.layout import should_save
from shardlm.checkpoint.ownership import run_id
from shardlm.config import Config, TrainConfig
from shardlm.data.context_split import split_batch, window_positions
from shardlm.data.dataset import Batch, GlobalBatchOrder, TokenDataset, build_dataset, micro_batch, micro_batch_start
from shardlm.data.fit import check_ids, load_tokenizer, vocab_size
from shardlm.data.rows import IGNORE_INDEX
from shardlm.distributed.clip import clip_grad_norm_
from shardlm.distributed.mesh import FreedMemory, Mesh, build_mesh, init_distributed
from shardlm.distributed.shards import as_local
from shardlm.errors import ConfigError
from shardlm.parallel.build import ParallelModel, parallelize
from shardlm.parallel.runtime.context import ContextShard, context_parallel, recompute_context
from shardlm.parallel.runtime.dropout import DeterministicDropout, DropoutKey, checkpoint_context_fn, lora_dropout_sites
from shardlm.parallel.runtime.ep import sum_expert_grads
from shardlm.parallel.runtime.grads import sum_tp_partial_grads
from shardlm.train import faults
from shardlm.train.compile import compile_blocks
from shardlm.train.evaluation import eval_loss
from shardlm.train.loss import token_loss_sum
from shardlm.train.metrics import (
    MetricsWriter,
    count_params,
    describe_trainable,
    max_over_ranks,
    mfu,
    peak_memory_mb,
    peak_tflops,
)
from shardlm.train.optim import build_optimizer, build_scheduler
from shardlm.train.pipeline_step import PipelineStep
from shardlm.train.router_loss import router_loss_of
from shardlm.train.tp_checks import check_tp_batches, check_tp_replicas, tp_replicated_params

log = logging.getLogger("shardlm")


def print0(*args) -> None:
    """Print on global rank 0 only (the one place user-facing progress is printed)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def _setup_rank_log(output_dir: str, run: str) -> None:
    """``logs/rankN.log``, appended to (a resumed run continues it); every line names the run's id."""
    rank = dist.get_rank()
    os.makedirs(os.path.join(output_dir, "logs"), exist_ok=True)
    handler = logging.FileHandler(os.path.join(output_dir, "logs", f"rank{rank}.log"))
    handler.setFormatter(logging.Formatter(f"%(asctime)s run {run} %(levelname)s %(message)s"))
    log.handlers = [handler]
    log.setLevel(logging.INFO)


def mixed_precision_policy(t: TrainConfig) -> MixedPrecisionPolicy | None:
    """What ``parallelize`` hands FSDP2 for ``train.bf16`` (used only where FSDP is on)."""
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if t.bf16 else None


def check_activation_checkpointing(model: nn.Module) -> None:
    """transformers can checkpoint this model's blocks (``shardlm.preflight`` asks before spawning)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        name = type(model).__name__
        raise ConfigError(f"train.gradient_checkpointing: {name} does not support activation checkpointing; set false")


def _checkpoint_contexts():
    """``context_fn`` of the checkpointed blocks: the recompute restarts the forward's dropout count
    (``dropout.checkpoint_context_fn``) and runs on the forward's context shard (``context.recompute_context``:
    under ``parallel.pp`` the schedule's backward runs outside the stage forward that held it)."""
    forward, dropout = checkpoint_context_fn()
    return forward, _Entered(dropout, recompute_context())


class _Entered:
    """``contexts`` entered together; reusable, as each context is (a split backward recomputes twice)."""

    def __init__(self, *contexts) -> None:
        self.contexts, self.stacks = contexts, []

    def __enter__(self):
        stack = ExitStack()
        for context in self.contexts:
            stack.enter_context(context)
        self.stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self.stacks.pop().__exit__(*exc)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant checkpointing of every decoder block, through transformers (see module docstring)."""
    check_activation_checkpointing(model)
    # context_fn: the recompute redraws the forward's dropout masks and attends over its context shard
    kwargs = {"use_reentrant": False, "context_fn": _checkpoint_contexts}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@dataclass
class Trainer:
    """Trains a parallelized model on a token dataset with the settings of ``config``.

    ``eval_dataset``: samples for ``evaluate``; by default built from ``config.eval.path``.
    ``history`` collects the records of logging steps, ``eval_history`` those of evaluations.
    ``run_id``: what metrics.jsonl records carry (``checkpoint/ownership.py``); None: a new one.
    """

    model: ParallelModel
    config: Config
    dataset: TokenDataset
    mesh: Mesh
    eval_dataset: TokenDataset | None = None
    history: list[dict] = field(default_factory=list)
    eval_history: list[dict] = field(default_factory=list)
    run_id: str | None = None

    def __post_init__(self) -> None:
        t = self.config.train
        self.module = self.model.module  # the nn.Module (``model`` is what ``parallelize`` returned)
        if t.gradient_checkpointing:
            enable_activation_checkpointing(self.module)
        if t.compile:
            compile_blocks(self.module)  # after checkpointing: the compiled forward includes it (train/compile.py)
        self.optimizer = build_optimizer(self.module, self.config)
        self.scheduler = build_scheduler(self.optimizer, self.config)
        self.order = GlobalBatchOrder(len(self.dataset), self.config.global_batch_size, t.seed)
        self.step = 0
        # bf16 by FSDP2's policy when the model was built with one, else by autocast
        self.autocast = t.bf16 and self.model.fsdp_param_dtype != torch.bfloat16
        if self.eval_dataset is None and self.config.eval.path:
            self.eval_dataset = build_eval_dataset(self.config)
        self._check_ids()
        # parallel.pp: the schedule runs this rank's stage over the step's micro-batches (train/pipeline_step.py)
        stage = self.model.stage
        self.pipeline = PipelineStep(stage, self.mesh, self.mesh.parallel, self.autocast) if stage is not None else None
        self.num_params = count_params(self.module)
        if self.pipeline is not None:  # a stage holds its own blocks (``parallel.pp``): the model is their sum
            self.num_params -= sum(p.numel() for p in self.pipeline.counted_elsewhere())  # a tied weight once
            total = torch.tensor(float(self.num_params), dtype=torch.float64, device=self.mesh.device)
            dist.all_reduce(total, group=self.mesh.pp.get_group())
            self.num_params = int(total)
        self.router_loss = router_loss_of(self.module)  # the load-balancing loss over the global batch, or None
        self._tp_checked = False
        self._has_dropout: bool | None = None  # known after the first forward (DeterministicDropout.used)
        self._tp_replicas = tp_replicated_params(self.module) if self.mesh.parallel.tp > 1 else []
        self._freed_memory = FreedMemory()  # the heap trimmed when a step ends above its level (distributed/mesh.py)
        lora_dropout_sites(self.module, self.model.plan, self.mesh.parallel.tp)
        self.state = checkpoint.TrainState(
            self.module, self.optimizer, self.scheduler, len(self.dataset), lora=self.model.lora
        )
        self.guard = faults.StepGuard(t.max_bad_steps)  # SIGTERM and non-finite steps (faults.py)

    def _check_ids(self) -> None:
        """Every sample's ids inside the model's vocabulary (``data/fit.py``): once over the whole data
        set each rank holds, so every layout answers the same before its first step, and no TP
        embedding masks an out-of-range id to a zero row."""
        vocab = vocab_size(self.module.config)
        if vocab is None:
            return
        check_ids(self.dataset.input_ids, vocab, "data.path")
        if self.eval_dataset is not None:
            check_ids(self.eval_dataset.input_ids, vocab, "eval.path")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``input_ids`` in the configured precision (autocast only where FSDP does not cast)."""
        return self.outputs(input_ids, position_ids).logits

    def outputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        """The model's outputs for ``input_ids`` (logits, and router logits where the model gives them).
        ``position_ids`` (document-packed windows, ``data/packing.py``): restarting at each document,
        with no attention mask, they make transformers build the block-diagonal causal mask."""
        ctx = torch.autocast(self.mesh.device.type, dtype=torch.bfloat16) if self.autocast else nullcontext()
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        with ctx:
            return self.module(input_ids=input_ids, **kwargs)

    def dropout_mode(self, micro: int, shard: ContextShard | None = None) -> DeterministicDropout | None:
        """The dropout mode of micro-step ``micro`` of this step (None once the model showed it has
        no dropout): this rank's samples are positions ``start..start+per_device`` of the global batch,
        and under context parallelism its tokens the window positions of ``shard``."""
        if self._has_dropout is False:
            return None
        t, p = self.config.train, self.mesh.parallel
        start = micro_batch_start(micro, self.mesh.dp_rank, p.dp_size, t.per_device_train_batch_size)
        positions = torch.arange(start, start + t.per_device_train_batch_size)
        sites = tuple(self.model.plan.dropout_sites)
        tp_rank = self.mesh.tp.get_local_rank() if p.tp > 1 else 0
        sequence = None if shard is None else (shard.index, shard.positions.shape[1])  # this cp rank's tokens
        return DeterministicDropout(DropoutKey(t.seed, self.step, positions, tp_rank, p.tp, sites, sequence))

    def _pipeline_dropout(self, micros: int) -> DropoutKey | None:
        """Under ``parallel.pp``: the step's dropout key over this rank's ``micros`` micro-batches joined (the
        schedule cuts them, and the positions with them, into its own micro-batches)."""
        modes = [self.dropout_mode(micro) for micro in range(micros)]
        if modes[0] is None:
            return None
        return dataclasses.replace(modes[0].key, positions=torch.cat([mode.key.positions for mode in modes]))

    def context_shard(self, batch: Batch) -> tuple[Batch, ContextShard | None]:
        """This rank's tokens of ``batch`` and the shard its attention gathers the others' over
        (``parallel/runtime/context.py``); the batch itself and None without context parallelism."""
        p = self.mesh.parallel
        if p.cp == 1:
            return batch, None
        cp_rank, group = self.mesh.cp.get_local_rank(), self.mesh.cp.get_group()
        shard = ContextShard(window_positions(batch), p.cp, cp_rank, group, p.cp_attention)
        return split_batch(batch, shard.index), shard

    def _micro_step(self, micro: int, batch: Batch, denom: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of micro-batch ``micro`` (``batch``: this dp rank's whole windows);
        this rank's token-loss sum and the router's ``coef * aux_loss`` (0 without one), detached.
        Under context parallelism the forward and backward both run on this rank's chunks, so
        that the recompute of a checkpointed block finds its shard."""
        local, shard = self.context_shard(batch)
        router_total = torch.zeros((), device=self.mesh.device)
        with context_parallel(shard):
            mode = self.dropout_mode(micro, shard)
            with mode or nullcontext():
                outputs = self.outputs(local.input_ids, local.position_ids)
            if mode is not None and self._has_dropout is None:
                self._has_dropout = mode.used
            micro_loss = token_loss_sum(outputs.logits, local.labels)
            roots = [micro_loss / denom]
            if self.router_loss is not None:  # one backward for both (train/router_loss.py)
                term, router_total = self.router_loss.terms(outputs.router_logits, self.mesh.sum_over_tokens)
                roots.append(term)
            torch.autograd.backward(roots)
        return as_local(micro_loss).detach(), router_total.detach()

    def train_step(self) -> dict:
        t, p = self.config.train, self.mesh.parallel
        start = time.perf_counter()
        device = self.mesh.device
        per_device, dp_rank = t.per_device_train_batch_size, self.mesh.dp_rank
        batches = [
            micro_batch(self.dataset, self.order, self.step, m, dp_rank, p.dp_size, per_device).to(device)
            for m in range(t.gradient_accumulation_steps)
        ]
        if p.tp > 1 and (not self._tp_checked or (self.step + 1) % t.logging_steps == 0):
            check_tp_batches(batches, self.mesh.tp.get_group(), self.step)
            self._tp_checked = True
        count = self.mesh.sum_over_dp(torch.stack([(b.labels != IGNORE_INDEX).sum() for b in batches]).sum().float())
        denom = max(float(count), 1.0)
        loss_sum, router_sum = torch.zeros((), device=device), torch.zeros((), device=device)
        if self.pipeline is not None:  # every micro-batch through the stages; the last stage's loss sum
            loss_sum = self.pipeline.forward_backward(batches, denom, self._pipeline_dropout(len(batches)))
        for micro, batch in enumerate(batches if self.pipeline is None else []):
            micro_loss, router_total = self._micro_step(micro, batch, denom)
            loss_sum += micro_loss
            router_sum += router_total
        loss = self.mesh.sum_over_tokens(loss_sum) / denom + router_sum
        if self.model.tp_partial_grads:
            sum_tp_partial_grads(self.module, self.model.tp_partial_grads, self.mesh.tp.get_group())
        if self.model.expert_grads:  # EP: over the data-parallel ranks holding the same experts
            sum_expert_grads(self.module, self.model.expert_grads, self.model.expert_dp_group)
        elsewhere = self.pipeline.counted_elsewhere() if self.pipeline is not None else ()  # a tied copy
        grad_norm = clip_grad_norm_(self.module.parameters(), t.max_grad_norm, stages=p.pp, elsewhere=elsewhere)
        lr = self.scheduler.get_last_lr()[0]
        skipped = self.guard.check(loss, grad_norm, self.step + 1)  # collective: same answer on every rank
        if not skipped:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._freed_memory.after_step()  # the step's activations and gradients are gone (distributed/mesh.py)
        self.step += 1
        if p.tp > 1 and (self.step <= 2 or self.step % t.logging_steps == 0):
            check_tp_replicas(self._tp_replicas, self.mesh.tp.get_group(), self.step)
        elapsed = time.perf_counter() - start
        # every rank's micro-batches are windows of one shape (data/dataset.py): no collective to count them
        tokens = sum(b.input_ids.numel() for b in batches) * p.dp_size
        record = {
            "step": self.step,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "learning_rate": lr,
            "tokens_per_second": tokens / elapsed,
            "step_time_s": elapsed,
        }
        if self.router_loss is not None:  # its share of ``loss``: router_aux_loss_coef * aux_loss
            record["router_loss"] = float(router_sum)
        return {**record, "skipped": True} if skipped else record

    def evaluate(self) -> dict:
        """Collective: token-weighted loss and perplexity over the eval set (``train/evaluation.py``)."""
        if self.eval_dataset is None:
            raise ConfigError("eval.path is not set: there is no eval data set to evaluate on")
        per_device = self.config.train.per_device_train_batch_size
        module, logits_of = self.module, self.forward
        if self.pipeline is not None:  # the batches through the stages in turn (train/pipeline_step.py)
            module, logits_of = self.model.stage, self.pipeline.logits_of
        loss, tokens = eval_loss(
            module,
            logits_of,
            self.eval_dataset,
            self.mesh,
            per_device,
            self.config.eval.max_batches,
            self.context_shard,
        )
        ppl = math.exp(loss) if loss < 700 else float("inf")
        return {"step": self.step, "eval_loss": loss, "eval_ppl": ppl, "eval_tokens": tokens}

    def _log_record(self, record: dict) -> None:
        """Add the whole-world numbers of a logging step: peak memory, and MFU on GPU."""
        device = self.mesh.device
        record["peak_memory_mb"] = max_over_ranks(peak_memory_mb(device), device)
        peak = peak_tflops(device, self.config.train.bf16) if device.type == "cuda" else None
        if peak:
            record["mfu"] = mfu(self.num_params, record["tokens_per_second"], dist.get_world_size(), peak)

    def train(self) -> list[dict]:
        """Train to ``train.max_steps`` (or until SIGTERM: then save and return); the logged records."""
        previous = faults.catch_sigterm()
        try:
            return self._train()
        finally:
            faults.restore_sigterm(previous)

    def _train(self) -> list[dict]:
        t, e = self.config.train, self.config.eval
        resumed = checkpoint.maybe_resume(self.state, self.config)  # model, optimizer, scheduler, RNG
        if resumed is not None:
            self.step = resumed["step"]
        self.run_id = self.run_id or run_id()  # collective where rank 0 names the run
        writer = MetricsWriter(t, self.step, append=bool(resumed), enabled=dist.get_rank() == 0, run_id=self.run_id)
        evaluated_at = None
        try:
            while self.step < t.max_steps:
                record = self.train_step()
                log.info(json.dumps(record))
                writer.step(record)
                if self.step % t.logging_steps == 0 or self.step == t.max_steps or "skipped" in record:
                    self._log_record(record)
                    self.history.append(record)
                    writer.log(record)
                self.guard.raise_if_too_many(self.step)
                if self.eval_dataset is not None and e.steps and self.step % e.steps == 0:
                    self._eval(writer)
                    evaluated_at = self.step
                saved = None
                if should_save(self.step, t.save_steps, t.max_steps):
                    saved = self.save_checkpoint()
                if self.guard.stop:  # some rank got SIGTERM: every rank stops after this same step
                    faults.stop_for_signal(self.step, saved or self.save_checkpoint())
                    break
            if self.eval_dataset is not None and evaluated_at != self.step and not self.guard.stop:
                self._eval(writer)
        except BaseException:
            writer.close(plot=False)  # keep the original error in front; no plot of a failed run
            raise
        writer.close()
        return self.history

    def save_checkpoint(self) -> str:
        """Collective: save this step's state (``checkpoint.manager``); the step directory."""
        return checkpoint.save_checkpoint(self.state, self.config, self.step)

    def load_checkpoint(self, step_dir: str) -> dict:
        """Collective: restore the state saved in ``step_dir`` and continue from its step; the marker."""
        marker = checkpoint.load_checkpoint(self.state, self.config, step_dir)
        self.step = marker["step"]
        return marker

    def _eval(self, writer: MetricsWriter) -> None:
        record = self.evaluate()
        log.info(json.dumps(record))
        self.eval_history.append(record)
        writer.log_eval(record)


def build_eval_dataset(cfg: Config, tokenizer=None) -> TokenDataset:
    """The samples of ``eval.path``, tokenized with the ``data`` settings (seq_len, packing, fields)."""
    data = dataclasses.replace(cfg.data, path=cfg.eval.path)
    return build_dataset(data, tokenizer or load_tokenizer(cfg), key="eval.path")


def run(cfg: Config) -> list[dict]:
    """One rank's whole job: join the world, build everything, train. Returns the logged records."""
    faults.catch_sigterm()  # a SIGTERM while the model is built is acted on after the first step
    init_distributed(cfg.train.timeout_s)
    mesh = build_mesh(cfg.parallel)
    run = run_id()
    _setup_rank_log(cfg.train.output_dir, run)
    log.info("rank %d of %d (pid %d), layout %s", dist.get_rank(), dist.get_world_size(), os.getpid(), cfg.parallel)
    tokenizer = load_tokenizer(cfg)
    dataset = build_dataset(cfg.data, tokenizer)
    print0(f"data: {len(dataset)} samples of {cfg.data.seq_len} tokens ({dataset.skipped_rows} rows skipped)")
    eval_dataset = build_eval_dataset(cfg, tokenizer) if cfg.eval.path else None
    if eval_dataset is not None:
        print0(f"eval data: {len(eval_dataset)} samples of {cfg.data.seq_len} tokens")
    frozen_dtype = torch.bfloat16 if cfg.lora is not None and cfg.train.bf16 else None
    model = parallelize(
        cfg.model,
        mesh,
        seed=cfg.train.seed,
        mp_policy=mixed_precision_policy(cfg.train),
        lora_config=cfg.lora,
        frozen_dtype=frozen_dtype,
        train_towers=cfg.train.train_vision_tower,
    )
    if cfg.lora is not None:
        print0(describe_trainable(model.module))
    history = Trainer(model, cfg, dataset, mesh, eval_dataset=eval_dataset, run_id=run).train()
    return history
