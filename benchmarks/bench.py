"""shardlm side by side with transformers' own distributed API: same model, batch, machine, run.

Why: a parallel trainer is only worth its complexity if it is at least as fast and as lean as
what ``transformers`` ships (``from_pretrained(distributed_config=DistributedConfig(...))``).
Per layout, one set of ranks builds both from the same safetensors and trains the same global
batch (4 x 128 tokens); transformers is driven by a plain AdamW loop with the same loss and the
same clipping attempt (``clip_grad_norm_``; what it refuses is recorded). Measured:

* throughput: 2 warm-up steps, then timed steps alternating shardlm / transformers (barriers on
  both ends) so load from other processes hits both alike; best step and median pair ratio;
* model state per rank (parameters + gradients + AdamW state, summed over the local tensors each
  rank holds) against the ideal ``16 bytes * params / (tp*fsdp)``; the resident memory a step
  adds (VmHWM reset before it); peak RSS per rank (``getrusage``, both frameworks loaded);
* bytes per rank per step of every collective, counted by a ``TorchDispatchMode`` that sees both
  DTensor's functional collectives and the c10d ops FSDP2 calls (payload = the full buffer:
  all-reduce input, all-gather output, reduce-scatter input), against ``analytic_comm_bytes``;
* one step of each profiled on rank 0 (torch.profiler; cProfile for the Python side);
* checkpoint I/O through ``benchmarks/checkpoint_io.py``; on CUDA, MFU.

    python benchmarks/bench.py [--steps 5] [--layouts tp2,fsdp2,tp2_fsdp2] [--no-profile]

Prints a Markdown table; writes everything to ``benchmarks/results/<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
# a Qwen3-MoE of the same width and depth: 8 experts of 256, 2 per token (its config's defaults
# otherwise: per-head q/k norms, every layer sparse), experts fused as transformers 5 stores them
MOE_MODEL = {
    **MODEL,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
}
MODELS = {"llama": ("LlamaConfig", MODEL), "qwen3_moe": ("Qwen3MoeConfig", MOE_MODEL)}
GLOBAL_BATCH, SEQ, WARMUP, LR, MAX_NORM = 4, 128, 2, 1e-4, 1.0
# layout name -> (model, layout)
LAYOUTS = {
    "tp2": ("llama", {"tp": 2}),
    "fsdp2": ("llama", {"fsdp": 2}),
    "tp2_fsdp2": ("llama", {"tp": 2, "fsdp": 2}),
    "moe_tp2": ("qwen3_moe", {"tp": 2}),
}
_COLLECTIVES = {
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "allreduce_",
    "_allgather_base_",
    "_reduce_scatter_base_",
    "allgather_",
    "reduce_scatter_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_tensor_coalesced_",
    "alltoall_base_",
    "broadcast_",
    "all_reduce_coalesced",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
}
# profiler events (self time) counted as communication: collectives, their waits, FSDP's gather/reduce ranges
_COMM_EVENTS = ("c10d::", "_c10d_functional::", "gloo:", "FSDP::all_gather", "FSDP::post_backward_reduce")


def write_model(path: str, name: str = "llama") -> str:
    """A benchmark model (``MODELS``) with random weights saved as safetensors: both frameworks load these."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, sizes = MODELS[name]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**sizes)).float().save_pretrained(path)
    return path


def make_dataset(steps: int):
    """Random tokens for ``steps`` global batches (labels: the next token, none ignored)."""
    from shardlm.data.dataset import TokenDataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH * steps, SEQ + 1), generator=g)
    return TokenDataset(ids[:, :-1].clone(), ids[:, 1:].clone())


class CommCounter(TorchDispatchMode):
    """Counts every collective this rank issues and its payload bytes (the largest buffer argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run first: its own collectives then come back through here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name, namespace = getattr(func, "_overloadpacket", func).__name__, getattr(func, "namespace", "")
        if (
            namespace in ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")
            and name in _COLLECTIVES
        ):
            groups = [*args, out]
            size = max(
                sum(t.numel() * t.element_size() for t in tree_flatten(g)[0] if isinstance(t, torch.Tensor))
                for g in groups
            )
            self.ops[f"{namespace}.{name}"][0] += 1
            self.ops[f"{namespace}.{name}"][1] += size
        return out


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the local pieces of parameters, gradients and optimizer state on this rank."""
    params = list({id(p): p for p in model.parameters()}.values())
    optim = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(optim),
    }


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _timed(step) -> tuple[float, float]:
    """(wall seconds of one step on the slowest rank, CPU seconds this rank's process spent on it).

    CPU time leaves out waiting (for a descheduled peer, a collective), so it stays meaningful
    on a machine shared with other work; wall time is what a user waits for."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    cpu = time.process_time() - cpu
    dist.barrier()
    return _max_over_ranks(time.perf_counter() - start), _max_over_ranks(cpu)


def _kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"{field}:\s+(\d+)", fh.read())[1])


def _step_peak_rss_mb(step) -> float | None:
    """Memory one step adds at its peak: on CUDA allocated bytes, on CPU resident memory (VmHWM,
    reset first, above the RSS before the step, after freed heap went back to the OS)."""
    if torch.cuda.is_available():
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return _max_over_ranks((torch.cuda.max_memory_allocated() - before) / 2**20)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        before = _kb("VmRSS")
        step()
        return _max_over_ranks((_kb("VmHWM") - before) / 1024)
    except (OSError, AttributeError):
        step()
        return None


def _profile(step, python: bool = True) -> dict:
    """One step under torch.profiler and, with ``python``, one under cProfile (rank 0 records)."""
    from torch.profiler import ProfilerActivity, profile

    if dist.get_rank() != 0:
        for _ in range(2 if python else 1):
            step()
        return {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    ops = sorted(((e.key, e.self_cpu_time_total / 1e6, e.count) for e in events), key=lambda x: -x[1])
    op_total = sum(s for _, s, _ in ops)
    adam = next((e.cpu_time_total / 1e6 for e in events if e.key.startswith("Optimizer.step")), 0.0)
    comm = sum(s for k, s, _ in ops if k.startswith(_COMM_EVENTS))
    dtensor = sum(s for k, s, _ in ops if k == "PythonSubclass" or "TorchTensor" in k or "Redistribute" in k)
    out = {
        "wall_s": wall,
        "aten_self_s": op_total,
        "python_and_dispatch_s": max(wall - op_total, 0.0),
        "collectives_s": comm,
        "dtensor_s": dtensor,
        "optimizer_step_s": adam,
        "top_ops": ops[:12],
    }
    if python:
        pr = cProfile.Profile()
        pr.enable()
        step()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(15)
        out["cprofile_tottime"] = buf.getvalue()
    return out


class Run:
    """One framework on this rank: ``step()`` trains one global batch; ``keep_grads`` skips zeroing."""

    name = ""
    clip = ""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.keep_grads = False
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer

    def step(self) -> None:
        raise NotImplementedError


class ShardlmRun(Run):
    """shardlm through its Python API: build_mesh, parallelize, Trainer.train_step."""

    name, clip = "shardlm", "global norm over all placements"

    def __init__(self, path: str, layout: dict, data) -> None:
        from shardlm import Trainer, build_mesh, parallelize
        from shardlm.config import Config, ParallelConfig, TrainConfig

        super().__init__()
        par = ParallelConfig(**layout)
        train = TrainConfig(
            output_dir=tempfile.mkdtemp(prefix="bench-"),
            max_steps=10_000,
            learning_rate=LR,
            per_device_train_batch_size=GLOBAL_BATCH // par.dp_size,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=MAX_NORM,
        )
        mesh = build_mesh(par)
        self.trainer = Trainer(parallelize(path, mesh), Config(model=path, parallel=par, train=train), data, mesh)
        self.model, self.optimizer = self.trainer.module, self.trainer.optimizer
        self._zero_grad = self.optimizer.zero_grad
        self.optimizer.zero_grad = lambda set_to_none=True: None if self.keep_grads else self._zero_grad(set_to_none)

    def step(self) -> None:
        self.losses.append(self.trainer.train_step()["loss"])


class TransformersRun(Run):
    """transformers' own API, ``from_pretrained(distributed_config=...)``, driven by a plain AdamW loop."""

    name, clip = "transformers", "torch.nn.utils.clip_grad_norm_"

    def __init__(self, path: str, layout: dict, data) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        from shardlm.data.dataset import GlobalBatchOrder

        super().__init__()
        self.tp, self.fsdp = layout.get("tp", 1), layout.get("fsdp", 1)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_size=self.tp, fsdp_size=self.fsdp), dtype=torch.float32
        )
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.data, self.order, self.index = data, GlobalBatchOrder(len(data), GLOBAL_BATCH, 0), 0
        self.tp_plan = dict(getattr(self.model, "tp_plan", {}) or {}) if self.tp > 1 else {}

    def step(self) -> None:
        from shardlm.data.dataset import micro_batch

        dp_rank, per_rank = dist.get_rank() // self.tp, GLOBAL_BATCH // self.fsdp
        batch = micro_batch(self.data, self.order, self.index, 0, dp_rank, self.fsdp, per_rank).to(_device())
        logits = self.model(input_ids=batch.input_ids).logits
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), reduction="sum")
        # FSDP averages gradients over its ranks: scale so they are the global-batch mean, as in shardlm
        (loss_sum * self.fsdp / (GLOBAL_BATCH * SEQ)).backward()
        if not self.clip.startswith("refused"):
            try:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
            except Exception as exc:  # noqa: BLE001 - recorded; the loop goes on without clipping
                self.clip = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:140]}"
        self.optimizer.step()
        if not self.keep_grads:
            self.optimizer.zero_grad(set_to_none=True)
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        self.losses.append(float(total) / self.tp / (GLOBAL_BATCH * SEQ))
        self.index += 1


def rank_main(path: str, layout: dict, steps: int, profile: bool) -> dict:
    """Both frameworks on this rank, timed step by step in alternation so machine noise hits both alike."""
    import warnings

    from transformers.utils import logging as hf_logging

    from shardlm import init_distributed

    warnings.filterwarnings("ignore")  # benchmark output only: FSDP/DTensor notices repeat on every rank
    hf_logging.disable_progress_bar()
    init_distributed()
    data = make_dataset(steps + 8)
    runs = [ShardlmRun(path, layout, data), TransformersRun(path, layout, data)]
    for run in runs:
        for _ in range(WARMUP):
            run.step()
    times: dict[str, list[float]] = {r.name: [] for r in runs}
    cpu: dict[str, list[float]] = {r.name: [] for r in runs}
    for _ in range(steps):
        for run in runs:
            wall, used = _timed(run.step)
            times[run.name].append(wall)
            cpu[run.name].append(used)
    out = {}
    for run in runs:
        with CommCounter() as counter:
            run.step()
        comm = {k: {"count": c, "bytes": b} for k, (c, b) in sorted(counter.ops.items())}
        run.keep_grads = True
        step_rss = _step_peak_rss_mb(run.step)
        state = state_bytes(run.model, run.optimizer)
        run.keep_grads = False
        run.optimizer.zero_grad(set_to_none=True)
        best = min(times[run.name])
        out[run.name] = {
            "step_s": times[run.name],
            "best_step_s": best,
            "tokens_per_s": GLOBAL_BATCH * SEQ / best,
            "cpu_s": cpu[run.name],
            "median_cpu_s": sorted(cpu[run.name])[len(cpu[run.name]) // 2],
            "comm": comm,
            "comm_bytes": int(_max_over_ranks(sum(v["bytes"] for v in comm.values()))),
            "state": state,
            "step_rss_mb": step_rss,
            "losses": run.losses,
            "clip": run.clip,
        }
        if profile:
            out[run.name]["profile"] = _profile(run.step, python=run.name == "shardlm")
    pairs = sorted(b / a for a, b in zip(times["shardlm"], times["transformers"], strict=True))
    out["speedup"] = pairs[len(pairs) // 2]  # median over back-to-back step pairs: transformers time / shardlm time
    out["cpu_ratio"] = out["transformers"]["median_cpu_s"] / out["shardlm"]["median_cpu_s"]
    out["transformers"]["tp_plan"] = runs[1].tp_plan
    out["peak_rss_mb"] = _max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


def param_counts(path: str, tp: int) -> dict[str, int]:
    """Full parameter count, and per TP rank: everything, and the decoder blocks alone (for FSDP's schedule)."""
    from shardlm.estimate.params import tp_local_elements
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model, decoder_blocks

    model = build_meta_model(path)
    plan = infer_plan(model, tp)
    styles, experts = plan.styles, plan.experts
    names = {id(m): n for n, m in model.named_modules()}
    blocks = sum(tp_local_elements(b, styles, tp, names[id(b)], experts) for b in decoder_blocks(model))
    return {
        "full": sum(p.numel() for p in model.parameters()),
        "tp_local": tp_local_elements(model, styles, tp, experts=experts),
        "tp_local_blocks": blocks,
    }


def analytic_comm_bytes(layout: dict, counts: dict[str, int]) -> int:
    """Least payload bytes per rank per step for this layout (fp32), as FSDP2 + Megatron TP schedule it.

    TP (per rank, T = tokens of its data-parallel shard, h hidden, L layers): every block
    all-reduces its output twice forward (attention, MLP or MoE: each expert split inside, as
    transformers' own plan does) and its input gradient twice backward;
    the vocab-parallel embedding all-reduces its output, the vocab-parallel LM head its input
    gradient; the loss on vocab shards all-reduces max, sum-exp and target logit per token:
    ``(4L + 2) * T*h + 3T``. FSDP: all-gather every parameter forward, the per-block ones again
    backward but the last block's (it and the root stay gathered, ``build.apply_fsdp``), reduce-scatter
    every gradient: ``2P + P_blocks (L - 1) / L`` (the bench models' blocks are of one size).
    """
    tp, fsdp = layout.get("tp", 1), layout.get("fsdp", 1)
    tokens = GLOBAL_BATCH // fsdp * SEQ
    total = 0
    if tp > 1:
        total += (4 * MODEL["num_hidden_layers"] + 2) * tokens * MODEL["hidden_size"] + 3 * tokens
    if fsdp > 1:
        layers = MODEL["num_hidden_layers"]
        total += 2 * counts["tp_local"] + counts["tp_local_blocks"] * (layers - 1) // layers
    return 4 * total


def mfu(tokens_per_s: float, params: int, world: int) -> float | None:
    """Model FLOPs utilization on CUDA (fp32 peak, as this benchmark runs fp32), from ``shardlm.train.metrics``."""
    from shardlm.train.metrics import mfu as model_flops_utilization
    from shardlm.train.metrics import peak_tflops

    peak = peak_tflops(_device(), bf16=False) if torch.cuda.is_available() else None
    return None if peak is None else model_flops_utilization(params, tokens_per_s, world, peak)


def checkpoint_io(repeats: int = 2) -> dict:
    """DCP vs safetensors save/load MB/s, from ``checkpoint_io.py`` (its own printed lines)."""
    script = os.path.join(HERE, "checkpoint_io.py")
    if not os.path.isfile(script):
        return {"skipped": "benchmarks/checkpoint_io.py not found"}
    proc = subprocess.run(
        [sys.executable, script, "--repeats", str(repeats)], capture_output=True, text=True, check=False
    )
    rows = {
        m[1].strip(): {"ms": float(m[2]), "mb_per_s": float(m[3])}
        for m in re.finditer(r"^\s+(.+?)\s+([\d.]+) ms\s+([\d.]+) MB/s$", proc.stdout, re.MULTILINE)
    }
    if proc.returncode or not rows:
        return {"skipped": f"checkpoint_io.py failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}"}
    return {"header": proc.stdout.strip().splitlines()[0], "rows": rows}


def run_layout(path: str, name: str, steps: int, profile: bool) -> dict:
    from shardlm.distributed.launch import RankFailed, spawn

    model, layout = LAYOUTS[name]
    world = layout.get("tp", 1) * layout.get("fsdp", 1)
    counts = param_counts(path, layout.get("tp", 1))
    out = {
        "model": model,
        "layout": layout,
        "world": world,
        "params": counts["full"],
        "ideal_state_bytes": 16 * counts["full"] // world,
        "analytic_comm_bytes": analytic_comm_bytes(layout, counts),
    }
    start = time.perf_counter()
    try:
        out.update(spawn(rank_main, world, path, layout, steps, profile)[0])
    except RankFailed as exc:
        out["failed"] = str(exc)
        return out
    out["wall_s"] = time.perf_counter() - start
    for key in ("shardlm", "transformers"):
        out[key]["mfu"] = mfu(out[key]["tokens_per_s"], counts["full"], world)
    return out


def _row(name: str, key: str, r: dict, ratio: str) -> str:
    m = r[key]
    state = sum(m["state"].values())
    mfu_text = f", MFU {m['mfu']:.1%}" if m.get("mfu") else ""
    rss = f"{m['step_rss_mb']:.0f}" if m["step_rss_mb"] is not None else "-"
    clip = m["clip"].split(", need")[0].split(", but got")[0]
    return (
        f"| {name} | {key} | {m['tokens_per_s']:,.0f} ({m['best_step_s'] * 1e3:.0f} ms{mfu_text}) "
        f"| {m['median_cpu_s'] * 1e3:.0f} | {ratio} | {m['losses'][0]:.5f} | {clip} | {state / 1e6:.2f} "
        f"| {state / r['ideal_state_bytes']:.3f} | {rss} | {m['comm_bytes'] / 1e6:.2f} "
        f"| {m['comm_bytes'] / r['analytic_comm_bytes']:.2f} |"
    )


def markdown(results: dict) -> str:
    moe = MODELS["qwen3_moe"][1]
    models = {r["model"]: r["params"] for r in results["layouts"].values()}
    sizes = []
    if "llama" in models:
        sizes.append(
            f"Llama {MODEL['hidden_size']} hidden x {MODEL['num_hidden_layers']} layers, {models['llama']:,} params"
        )
    if "qwen3_moe" in models:
        sizes.append(
            f"moe_*: Qwen3-MoE of the same width and depth, {moe['num_experts']} experts of "
            f"{moe['moe_intermediate_size']}, top-{moe['num_experts_per_tok']}, {models['qwen3_moe']:,} params"
        )
    lines = [
        (
            f"{'; '.join(sizes)}, "
            f"global batch {GLOBAL_BATCH} x {SEQ} tokens, fp32, {results['steps']} timed steps per framework "
            f"(alternating) after {WARMUP} warm-up, {results['machine']}, torch {results['torch']}. tokens/s: best "
            "step; speedup: transformers time / shardlm time, median over back-to-back step pairs (wall) and of "
            "median CPU time per rank (CPU)"
        ),
        "",
        (
            "| layout | framework | tokens/s (best step) | CPU ms/step/rank | speedup wall, CPU | step-1 loss "
            "| clipping | state MB/rank | vs ideal | step RSS +MB | comm MB/step/rank | vs minimum |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, r in results["layouts"].items():
        if "failed" in r:
            lines.append(f"| {name} | both | failed: {r['failed']} |" + " |" * 9)
            continue
        ratio = f"{r['speedup']:.2f}x, {r['cpu_ratio']:.2f}x"
        lines += [_row(name, "shardlm", r, ratio), _row(name, "transformers", r, "")]
        notes.append(f"{name}: peak RSS per rank {r['peak_rss_mb']:.0f} MB (both frameworks in one process)")
    ck = results["checkpoint_io"]
    lines += ["", *notes, ""]
    if "rows" in ck:
        rows = ", ".join(f"{k} {v['mb_per_s']:.0f} MB/s" for k, v in ck["rows"].items())
        lines.append(f"Checkpoint I/O ({ck['header']}): {rows}")
    else:
        lines.append(f"Checkpoint I/O: skipped ({ck['skipped']})")
    for name, r in results["layouts"].items():
        for key in ("shardlm", "transformers"):
            prof = r.get(key, {}).get("profile")
            if prof:
                top = ", ".join(f"{k} {s * 1e3:.0f}" for k, s, _ in prof["top_ops"][:5])
                lines.append(
                    f"Profile {key} {name} (one step, rank 0, ms): wall {prof['wall_s'] * 1e3:.0f} = ops "
                    f"{prof['aten_self_s'] * 1e3:.0f} (collectives {prof['collectives_s'] * 1e3:.0f}, DTensor "
                    f"dispatch {prof['dtensor_s'] * 1e3:.0f}) + other Python "
                    f"{prof['python_and_dispatch_s'] * 1e3:.0f}; AdamW step {prof['optimizer_step_s'] * 1e3:.0f}"
                    f"; top: {top}"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per framework")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled shardlm step")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="directory of the JSON results")
    args = parser.parse_args()
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        sys.exit(f"error: unknown layout {unknown[0]}; choose from {', '.join(LAYOUTS)}")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    machine = f"{torch.cuda.get_device_name()}" if torch.cuda.is_available() else f"CPU x{os.cpu_count()}, gloo"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardlm-bench-") as tmp:
        paths = {m: write_model(os.path.join(tmp, m), m) for m in sorted({LAYOUTS[n][0] for n in names})}
        layouts = {n: run_layout(paths[LAYOUTS[n][0]], n, args.steps, not args.no_profile) for n in names}
    results = {
        "models": {m: MODELS[m][1] for m in paths},
        "global_batch": GLOBAL_BATCH,
        "seq": SEQ,
        "steps": args.steps,
        "warmup": WARMUP,
        "machine": machine,
        "torch": torch.__version__,
        "layouts": layouts,
        "checkpoint_io": checkpoint_io(),
    }
    results["wall_s"] = time.perf_counter() - start
    print(markdown(results))
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, time.strftime("%Y%m%d-%H%M%S") + ".json")
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    print(f"\nresults: {out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
