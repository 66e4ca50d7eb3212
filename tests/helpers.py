"""Tiny models, tiny data, a plain one-process reference, and real multi-process runs.

``run_ranks`` runs a rank body on pooled processes (tests/pool.py: started once per world size,
a fresh process group and port per job); ``run_fresh_ranks`` goes through
``shardlm.distributed.launch.spawn``, the launcher users' runs take, for tests of the launcher
and of a process's memory.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pool
import torch
import torch.nn.functional as F
from families import VOCAB
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from shardlm.config import Config, ParallelConfig, TrainConfig
from shardlm.data.dataset import GlobalBatchOrder, TokenDataset
from shardlm.distributed.launch import spawn

SEQ = 16


def tiny_config(family: str = "llama", **overrides):
    """A random-init config of ``family`` small enough for 2-core CI (the shapes live in families.py)."""
    from families import family_config

    return family_config(family, **{"max_position_embeddings": 64, **overrides})


def write_model_dir(path: str, family: str = "llama", **overrides) -> str:
    os.makedirs(path, exist_ok=True)
    tiny_config(family, **overrides).save_pretrained(path)
    return path


def write_gemma3(path: str, blocks: int = 4) -> str:
    """Gemma 3 text, untied, ``blocks`` blocks of which the second is full attention and the rest slide over 4
    tokens (its embedding scales inside the embedding module, so a later stage starts from what it receives)."""
    from transformers import Gemma3TextConfig

    kinds = ["sliding_attention", "full_attention"] + ["sliding_attention"] * (blocks - 2)
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config = Gemma3TextConfig(
        **sizes, num_hidden_layers=blocks, head_dim=8, sliding_window=4, layer_types=kinds, tie_word_embeddings=False
    )
    config.max_position_embeddings = 64
    config.save_pretrained(path)
    return path


def token_dataset(n: int = 24, seq: int = SEQ, seed: int = 1, vocab: int = VOCAB) -> TokenDataset:
    """Random tokens of ``[0, vocab)`` with padding-like IGNORE labels, including wholly ignored samples
    (``vocab``: the model's whole vocabulary where every rank's rows of an uneven split must be targets)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq + 1), generator=g)
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


def load_checked(path: str | None = None, overrides: list[str] | None = None, raw: dict | None = None) -> Config:
    """What ``shardlm train`` checks before spawning: the config's values, then the model-aware
    checks of ``shardlm.preflight``."""
    from shardlm.config import load_config
    from shardlm.preflight import check_run

    cfg = load_config(path, overrides, raw)
    check_run(cfg)
    return cfg


def shardlm_losses(
    model_paths: list[str],
    layout: dict,
    per_device: int,
    accum: int,
    steps: int = 5,
    train: dict | None = None,
    vocab: int = VOCAB,
    seq: int = SEQ,
) -> dict:
    """Rank body: train each model with shardlm's API on this rank's layout; (loss, grad_norm) per step;
    ``train``: ``TrainConfig`` values other than ``train_config``'s; ``vocab``, ``seq``: the data's ids and
    tokens a sample (``token_dataset``)."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    out = {}
    for path in model_paths:
        cfg = train_config(path, layout, per_device, accum, steps, **(train or {}))
        mesh = build_mesh(cfg.parallel)
        model = parallelize(path, mesh, seed=cfg.train.seed)
        history = Trainer(model, cfg, token_dataset(vocab=vocab, seq=seq), mesh).train()
        out[path] = [(h["loss"], h["grad_norm"]) for h in history]
    return out


def run_ranks(fn, world_size: int, *args):
    """Run ``fn(*args)`` on ``world_size`` real processes (gloo, localhost), kept alive between
    tests (tests/pool.py); rank 0's result."""
    return pool.run(fn, world_size, *args)[0]


def run_fresh_ranks(fn, world_size: int, *args):
    """``run_ranks`` on new processes started by shardlm's launcher (``spawn``). The pooled
    workers are stopped first (the next pooled job starts new ones): the launcher forwards a
    SIGTERM it receives to every multiprocessing child of its process, which in a test process
    includes the pool (test_faults sends one to the launcher)."""
    pool.shutdown()
    return spawn(fn, world_size, *args)[0]


def plain_reference(
    model_path: str,
    global_batch: int,
    steps: int = 5,
    seed: int = 0,
    optimizer=None,
    wrap=None,
    dropout=False,
    router_losses: list | None = None,
    vocab: int = VOCAB,
    seq: int = SEQ,
    **train,
) -> list[tuple[float, float]]:
    """One process, no shardlm training code: transformers model (its seeded init values from
    ``shardlm.parallelize.reference_model``, block by block), mean F.cross_entropy over the
    whole global batch, torch's clip_grad_norm_, AdamW (or ``optimizer(groups, train_cfg)``)
    and the HF scheduler. ``wrap(model)``: e.g. peft's ``PeftModel.from_pretrained``; only the
    parameters that then require grad train. ``dropout``: the model's dropout as shardlm draws it
    (``shardlm.parallel.runtime.dropout``, keyed by seed, step and the sample's position in the global batch);
    otherwise torch's own (use it only with dropout 0). A model whose config turns the router's
    load-balancing loss on (``output_router_logits``) adds ``router_aux_loss_coef * outputs.aux_loss``,
    as transformers does; ``router_losses`` collects that term per step. ``vocab``, ``seq``: the data's ids
    and tokens a sample (``token_dataset``). ``train``: ``TrainConfig`` values other than ``train_config``'s
    (as ``shardlm_losses`` takes them)."""
    from contextlib import nullcontext

    from transformers import get_scheduler

    from shardlm.parallel.runtime.dropout import DeterministicDropout, DropoutKey, lora_dropout_sites
    from shardlm.parallel.weights.fill import reference_model

    cfg = train_config(model_path, {}, global_batch, 1, steps, **train)
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
    data = token_dataset(vocab=vocab, seq=seq)
    order = GlobalBatchOrder(len(data), global_batch, t.seed)
    out = []
    for step in range(steps):
        idx = torch.tensor(order.indices(step))
        key = DropoutKey(t.seed, step, torch.arange(global_batch))
        with DeterministicDropout(key) if dropout else nullcontext():
            outputs = model(input_ids=data.input_ids[idx])
        loss = F.cross_entropy(outputs.logits.flatten(0, 1), data.labels[idx].flatten(), ignore_index=-100)
        if getattr(outputs, "aux_loss", None) is not None:  # output_router_logits: what transformers adds
            router = model.router_aux_loss_coef * outputs.aux_loss
            loss = loss + router
            if router_losses is not None:
                router_losses.append(router.item())
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


# ---------------------------------------------------------------- shardlm runs (rank bodies)

LAYOUTS = {
    "tp2": ({"tp": 2}, 4, 1),
    "fsdp2": ({"fsdp": 2}, 1, 2),
    "tp2_fsdp2": ({"tp": 2, "fsdp": 2}, 2, 1),
    "one": ({}, 2, 2),
}
STEPS = 10


def train(model_path: str, layout: str, output_dir: str, vocab: int = VOCAB, **train_kw) -> list[float]:
    """One shardlm run on this process's world (any rank); the logged losses (``vocab``: the data's ids)."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(model_path, shape, per_device, accum, STEPS, output_dir=output_dir, save_steps=5, **train_kw)
    mesh = build_mesh(cfg.parallel)
    data = token_dataset(vocab=vocab)
    return [h["loss"] for h in Trainer(parallelize(model_path, mesh), cfg, data, mesh).train()]


def train_jobs(jobs: list[tuple]) -> list[list[float]]:
    """Rank body: several runs one after another in one job (they share one set of processes and one process group)."""
    return [train(*job[:3], **(job[3] if len(job) > 3 else {})) for job in jobs]


def make_adapter(model_path: str, out: str, targets: list[str], seed: int = 0, dropout: float = 0.0) -> str:
    """A peft adapter for the seeded base of ``model_path`` with random (non-zero) lora_B, so
    every gradient path is live from step 1 (``dropout``: its ``lora_dropout``)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from shardlm.parallel.weights.fill import reference_model

    base = reference_model(model_path, seed)
    conv = any(type(m).__name__ == "Conv1D" for m in base.modules())
    cfg = PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=conv, lora_dropout=dropout)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(out)
    return out


# ---------------------------------------------------------------- collectives


class CountCollectives(TorchDispatchMode):
    """Counts collective ops reaching the dispatcher (functional and in-place c10d ops)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into collectives first, then count them
        if func.namespace in ("_c10d_functional", "c10d_functional", "c10d") and func.overloadpacket.__name__ not in (
            "wait_tensor",
            "_wrap_tensor_autograd",
        ):
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def model_collectives(model, mesh) -> list[dict]:
    """Collectives of one micro-batch of ``model``: forward, loss, backward, and the trainer's sum
    of TP-partial gradients."""
    from shardlm.parallel.runtime.grads import sum_tp_partial_grads
    from shardlm.train.loss import token_loss_sum

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    modes = [CountCollectives() for _ in range(4)]
    with modes[0]:
        logits = model.module(input_ids=ids).logits
    with modes[1]:
        loss = token_loss_sum(logits, ids)
    with modes[2]:
        loss.backward()
    with modes[3]:
        if model.tp_partial_grads:
            sum_tp_partial_grads(model.module, model.tp_partial_grads, mesh.tp.get_group())
    return [dict(m.counts) for m in modes]


# ---------------------------------------------------------------- the command line as users run it

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "examples" / "tiny-llama"


def write_cli_model(path: Path) -> Path:
    """A tiny random Llama (vocab 512 = the shipped tokenizer's) with that tokenizer beside it."""
    write_model_dir(str(path), "llama", vocab_size=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, path / name)
    return path


def start_cli(config: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "shardlm.cli", "train", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=config.parent,
        start_new_session=True,  # its own process group, so a timeout can stop spawned ranks too
    )


def finish_cli(procs: dict, timeout: float) -> dict:
    """``{key: (returncode, stdout, stderr)}`` of started commands; any still running on the way out is killed."""
    try:
        results = {}
        for key, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=timeout)
            results[key] = (proc.returncode, stdout, stderr)
        return results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
