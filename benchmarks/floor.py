"""How far a step is from its floor: compute alone + collectives alone, per bench layout.

For ``tp2`` and ``fsdp2`` on the bench model (``bench.MODEL``, global batch 4 x 128, fp32, AdamW):

On a shared machine trust the CPU columns (as benchmarks/README.md says): wall time there
includes time spent descheduled. Wall figures are minima (the least disturbed step), CPU medians.

* **measured**: shardlm's step (``bench.ShardlmRun``: ``Trainer.train_step``), 2 warm-up steps
  then ``--steps`` timed ones, wall (slowest rank) and CPU time (this rank's process);
* **communication alone**: one step's collectives recorded call by call (op, payload bytes; a
  ``TorchDispatchMode`` like ``bench.CommCounter``) and replayed through gloo on the same ranks,
  the same ops on tensors of the same sizes, nothing else running (median of ``--steps`` replays);
* **compute alone**: one process on one thread (``torch.set_num_threads(1)``, as each of the two
  ranks gets on this 2-core machine) doing one rank's work: under tp2 the model at a rank's local
  shapes (half the heads, half the intermediate, half the vocabulary) on the whole batch, forward,
  loss, backward and AdamW; under fsdp2 the whole model on half the batch and AdamW over half the
  parameters. Collectives and DTensor/FSDP bookkeeping are what it leaves out.

``floor = compute + communication``; the step is ``measured / floor - 1`` above it.

``one``: the whole model on the whole batch in one process, compute alone, on every core (``os.cpu_count()``
threads, as ``against.py``'s ``one``) and on one thread. With ``tp2`` beside it, the best TP efficiency the
machine allows: one process's wall over a tp2 rank's floor (its compute alone on one thread + its collectives
alone, wall), what ``against.py``'s ``TP efficiency`` would read if a tp2 step cost nothing beyond its floor;
and the same against one process whose threads scaled perfectly (one thread's wall / cores).

    python benchmarks/floor.py [--layouts tp2,fsdp2,tp2_fsdp2,one] [--steps 5]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import (  # noqa: E402
    GLOBAL_BATCH,
    LAYOUTS,
    LR,
    MODEL,
    SEQ,
    WARMUP,
    CommCounter,
    ShardlmRun,
    _timed,
    make_dataset,
    write_model,
)


class CommRecorder(CommCounter):
    """``CommCounter`` that also keeps each call in order: (op name, payload bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {k: v[0] for k, v in self.ops.items()}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for key, (count, _) in self.ops.items():
            if count != before.get(key, 0):
                tensors = [t for t in tree_flatten([args, out])[0] if isinstance(t, torch.Tensor)]
                self.calls.append((key.split(".")[-1], max(t.numel() * t.element_size() for t in tensors)))
        return out


def replay(calls: list[tuple[str, int]]) -> tuple[float, float]:
    """Issue ``calls`` through the default group on fp32 tensors of their sizes; (wall seconds,
    slowest rank; CPU seconds of this process: gloo's own work, copies and waiting spun)."""
    world = dist.get_world_size()
    buffers = [torch.zeros(max(1, size // 4)) for _, size in calls]
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for (name, _), buf in zip(calls, buffers, strict=True):
        if "gather" in name:  # payload = the gathered output
            dist.all_gather_into_tensor(buf, buf[: buf.numel() // world].clone())
        elif "reduce_scatter" in name:  # payload = the input
            dist.reduce_scatter_tensor(buf[: buf.numel() // world].clone(), buf)
        elif "broadcast" in name:
            dist.broadcast(buf, 0)
        else:
            dist.all_reduce(buf)
    used = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - start, used


def rank_main(path: str, layout: dict, steps: int) -> dict:
    """On every rank: the measured step, then its collectives replayed alone."""
    from shardlm import init_distributed

    init_distributed()
    run = ShardlmRun(path, layout, make_dataset(steps + WARMUP + 2))
    for _ in range(WARMUP):
        run.step()
    timed = [_timed(run.step) for _ in range(steps)]
    with CommRecorder() as recorder:
        run.step()
    replays = [replay(recorder.calls) for _ in range(steps)]
    return {
        "wall_ms": 1e3 * min(w for w, _ in timed),
        "cpu_ms": 1e3 * statistics.median(c for _, c in timed),
        "collectives": len(recorder.calls),
        "comm_mb": sum(s for _, s in recorder.calls) / 1e6,
        "comm_ms": 1e3 * min(w for w, _ in replays),
        "comm_cpu_ms": 1e3 * statistics.median(c for _, c in replays),
    }


def local_model(layout: dict) -> tuple[torch.nn.Module, int, int]:
    """A Llama at one rank's local shapes; (model, its vocabulary, sequences it sees a step)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tp, fsdp = layout.get("tp", 1), layout.get("fsdp", 1)
    sizes = dict(MODEL, head_dim=MODEL["hidden_size"] // MODEL["num_attention_heads"])
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        sizes[key] = sizes[key] // tp
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**sizes)).float(), sizes["vocab_size"], GLOBAL_BATCH // fsdp


def compute_alone(layout: dict, steps: int, threads: int = 1) -> dict:
    """One rank's compute on ``threads`` threads: forward, loss, backward, AdamW (module docstring)."""
    torch.set_num_threads(threads)
    model, vocab, batch = local_model(layout)
    fsdp = layout.get("fsdp", 1)
    params = list(model.parameters())
    # FSDP: the optimizer steps this rank's 1/fsdp of every parameter (flat pieces stand in for them)
    shards = [torch.zeros(math.ceil(p.numel() / fsdp), requires_grad=True) for p in params] if fsdp > 1 else params
    optimizer = torch.optim.AdamW(shards, lr=LR, foreach=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, SEQ + 1), generator=g)

    def step() -> None:
        logits = model(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum") / (GLOBAL_BATCH * SEQ)
        loss.backward()
        if fsdp > 1:
            for s in shards:
                s.grad = torch.ones_like(s)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return {"wall_ms": 1e3 * min(w for w, _ in times), "cpu_ms": 1e3 * statistics.median(c for _, c in times)}


def main() -> None:
    from shardlm.distributed.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="tp2,fsdp2")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    print(f"{time.strftime('%Y-%m-%d %H:%M')} UTC, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(os.path.join(tmp, "llama"))
        floors: dict[str, float] = {}
        for name in args.layouts.split(","):
            if name == "one":
                serial = compute_alone({}, args.steps)
                one = compute_alone({}, args.steps, threads=os.cpu_count() or 1)
                floors[name], floors["serial"] = one["wall_ms"], serial["wall_ms"]
                print(
                    f"one: {os.cpu_count()} threads {one['wall_ms']:.0f} ms wall, {one['cpu_ms']:.0f} ms CPU; "
                    f"1 thread {serial['wall_ms']:.0f} ms wall, {serial['cpu_ms']:.0f} ms CPU"
                )
                continue
            _, layout = LAYOUTS[name]
            world = layout.get("tp", 1) * layout.get("fsdp", 1)
            step = spawn(rank_main, world, path, layout, args.steps)[0]
            compute = compute_alone(layout, args.steps)
            floor = compute["wall_ms"] + step["comm_ms"]
            cpu_floor = compute["cpu_ms"] + step["comm_cpu_ms"]
            floors[name] = floor
            print(
                f"{name}: step {step['wall_ms']:.0f} ms wall, {step['cpu_ms']:.0f} ms CPU/rank; "
                f"compute alone {compute['wall_ms']:.0f} ms wall, {compute['cpu_ms']:.0f} ms CPU; "
                f"{step['collectives']} collectives, {step['comm_mb']:.2f} MB, alone {step['comm_ms']:.1f} ms wall, "
                f"{step['comm_cpu_ms']:.1f} ms CPU; floor {floor:.0f} ms wall, {cpu_floor:.0f} ms CPU: the step is "
                f"{100 * (step['wall_ms'] / floor - 1):.0f}% (wall), "
                f"{100 * (step['cpu_ms'] / cpu_floor - 1):.0f}% (CPU) above it",
                flush=True,
            )
        if "one" in floors and "tp2" in floors:
            ideal = floors["serial"] / (os.cpu_count() or 1)
            print(
                f"best TP efficiency (one's wall / tp2's floor wall): {floors['one'] / floors['tp2']:.2f}; "
                f"against one process scaling perfectly (1 thread's wall / cores): {ideal / floors['tp2']:.2f}"
            )


if __name__ == "__main__":
    main()
