"""Pipeline parallelism measured: pp=2 against fsdp=2 and tp=2, and the bubble of each schedule.

Why a script of its own: transformers trains no pipeline, so ``bench.py``'s side-by-side has no
other side here; this one compares shardlm's layouts with each other on ``bench.py``'s model and
global batch (4 x 128 tokens, fp32, AdamW, clipping at 1.0). Every run lives in the same two ranks
(one world, each run its own mesh and trainer) and the timed steps alternate run by run, barriers on
both ends, so load from other processes hits them alike. Per run:

* CPU ms per step and rank (median; the number to trust on a shared machine) and the best wall;
* model state per rank (local pieces of parameters, gradients, AdamW state: ``bench.state_bytes``),
  the resident memory a step adds (``bench._step_peak_rss_mb``), and the peak bytes autograd holds
  saved at once during a step (storages, parameters aside, each counted until backward releases it:
  a pipeline's first stage keeps the activations of every micro-batch in flight);
* pp runs: where each rank's schedule step goes, from the schedule's own actions: compute (the
  stage's ``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk`` and the loss)
  and the time waiting for P2P receives (``_wait_batch_p2p``), both wall time inside the schedule's
  ``step``; the measured bubble is ``1 - compute / schedule step``, against the schedule's formula:
  GPipe and 1F1B ``(p-1)/(m+p-1)`` (Huang et al. 2019; Narayanan et al. 2021), Interleaved1F1B with
  ``v`` stages a rank ``(p-1)/(v m+p-1)`` (Narayanan et al. 2021), the zero-bubble ones of Qi et al.
  2024 (arXiv 2401.10241) from the measured per-stage times of a forward ``F``, an input backward
  ``B`` and a weight backward ``W``: ZB-H1 (torch's InterleavedZeroBubble, ``v`` stages a rank) idles
  ``(p-1)(F+B-W)`` against ``v m (F+B+W)`` of compute, ZB-V ``max(0, (p-1)(F+B-2W))`` against
  ``2 m (F+B+W)`` (zero when the three are equal).

    python benchmarks/pipeline.py [--runs pp2_1f1b,fsdp2,tp2] [--all] [--steps 5]

``make bench`` runs the default (pp2 under 1F1B, fsdp2, tp2); ``--all`` adds GPipe, Interleaved1F1B,
InterleavedZeroBubble and ZBVZeroBubble at pp=2. Prints Markdown tables; writes the numbers to
``benchmarks/results/pipeline-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules, stage
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import (  # noqa: E402 - the bench's model, batch and measures, one source of truth
    GLOBAL_BATCH,
    HERE,
    MODEL,
    SEQ,
    WARMUP,
    ShardlmRun,
    _max_over_ranks,
    _step_peak_rss_mb,
    _timed,
    make_dataset,
    state_bytes,
    write_model,
)

MICROBATCHES = 4  # of one row each: the data-parallel rank's batch of a step at pp=2
RUNS = {
    "pp2_1f1b": {"pp": 2, "pp_schedule": "1F1B", "pp_microbatches": MICROBATCHES},
    "pp2_gpipe": {"pp": 2, "pp_schedule": "GPipe", "pp_microbatches": MICROBATCHES},
    "pp2_interleaved": {"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_microbatches": MICROBATCHES},
    "pp2_zb1p": {"pp": 2, "pp_schedule": "InterleavedZeroBubble", "pp_microbatches": MICROBATCHES},
    "pp2_zbv": {"pp": 2, "pp_schedule": "ZBVZeroBubble", "pp_microbatches": MICROBATCHES},
    "fsdp2": {"fsdp": 2},
    "tp2": {"tp": 2},
}
DEFAULT = "pp2_1f1b,fsdp2,tp2"


class ScheduleClock:
    """Wall time inside the pipeline schedule's actions on this rank, by kind, while ``on``: torch's stage
    methods and P2P wait wrapped once for the process (they are looked up by name at every call)."""

    def __init__(self) -> None:
        self.on = False
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        methods = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}
        for name, kind in methods.items():
            setattr(stage._PipelineStageBase, name, self._wrap(getattr(stage._PipelineStageBase, name), kind))
        for owner in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
            owner._maybe_compute_loss = self._wrap(owner._maybe_compute_loss, "loss")
        schedules._wait_batch_p2p = self._wrap(schedules._wait_batch_p2p, "wait")

    def _wrap(self, fn, kind: str):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            if kind == "B" and not kwargs.get("full_backward", True):
                key = "B_input"
            elif kind == "B":
                key = "B_full"
            else:
                key = kind
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[key] += time.perf_counter() - start
                self.calls[key] += 1

        return timed

    def reset(self) -> None:
        self.spent.clear()
        self.calls.clear()


class SavedPeak:
    """``saved_tensors_hooks`` counting the storages autograd keeps saved (parameters aside, DTensors by
    their local pieces), each until the graph holding it is released, and the peak of their bytes."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.refs, self.live, self.peak = params, {}, 0, 0

    def pack(self, t: torch.Tensor):
        local = t._local_tensor if isinstance(t, DTensor) else t
        return t if local.untyped_storage().data_ptr() in self.params else _Held(self, t, local)

    def unpack(self, held):
        return held.t if isinstance(held, _Held) else held


class _Held:
    """A saved tensor, counted by ``counter`` while autograd keeps it."""

    def __init__(self, counter: SavedPeak, t: torch.Tensor, local: torch.Tensor) -> None:
        storage = local.untyped_storage()
        self.counter, self.t, self.ptr, self.bytes = counter, t, storage.data_ptr(), storage.nbytes()
        counter.refs[self.ptr] = counter.refs.get(self.ptr, 0) + 1
        if counter.refs[self.ptr] == 1:
            counter.live += self.bytes
            counter.peak = max(counter.peak, counter.live)

    def __del__(self) -> None:
        self.counter.refs[self.ptr] -= 1
        if self.counter.refs[self.ptr] == 0:
            self.counter.live -= self.bytes


def saved_peak(run: ShardlmRun) -> int:
    """Peak bytes autograd holds saved at once during one step of ``run`` on this rank."""
    locals_ = (p._local_tensor if isinstance(p, DTensor) else p for p in run.model.parameters())
    counter = SavedPeak({p.untyped_storage().data_ptr() for p in locals_})
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        run.step()
    return counter.peak


def _timed_schedule(run: ShardlmRun, clock: ScheduleClock) -> tuple[float, float, dict]:
    """One timed step; for a pp run also the wall time of the schedule's ``step`` and its parts on this rank."""
    pipeline = run.trainer.pipeline
    if pipeline is None:
        return (*_timed(run.step), {})
    inner = pipeline.schedule.step
    box = {}

    def step(*args, **kwargs):
        clock.reset()
        clock.on, start = True, time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            clock.on = False
            box.update(schedule=time.perf_counter() - start, **clock.spent)
            box.update({f"n_{k}": v for k, v in clock.calls.items()})

    pipeline.schedule.step = step
    try:
        wall, cpu = _timed(run.step)
    finally:
        del pipeline.schedule.step
    return wall, cpu, box


def rank_main(path: str, names: list[str], steps: int) -> dict:
    """Every run of ``names`` in this world's ranks, timed step by step in alternation."""
    import warnings

    from shardlm import init_distributed

    warnings.filterwarnings("ignore")
    init_distributed()
    clock = ScheduleClock()
    data = make_dataset(steps + WARMUP + 4)
    runs = {name: ShardlmRun(path, RUNS[name], data) for name in names}
    for run in runs.values():
        for _ in range(WARMUP):
            run.step()
    timed = {name: {"wall": [], "cpu": [], "parts": []} for name in names}
    for _ in range(steps):
        for name, run in runs.items():
            wall, cpu, parts = _timed_schedule(run, clock)
            timed[name]["wall"].append(wall)
            timed[name]["cpu"].append(cpu)
            timed[name]["parts"].append(parts)
    out = {}
    for name, run in runs.items():
        run.keep_grads = True
        step_rss = _step_peak_rss_mb(run.step)
        state = state_bytes(run.model, run.optimizer)
        run.keep_grads = False
        run.optimizer.zero_grad(set_to_none=True)
        every = [None] * dist.get_world_size()
        mine = {"state": state, "saved_peak": saved_peak(run), "parts": timed[name]["parts"]}
        dist.all_gather_object(every, mine)
        cpu = sorted(timed[name]["cpu"])
        out[name] = {
            "layout": RUNS[name],
            "wall_s": timed[name]["wall"],
            "best_wall_s": min(timed[name]["wall"]),
            "cpu_s": timed[name]["cpu"],
            "median_cpu_s": cpu[len(cpu) // 2],
            "step_rss_mb": step_rss,
            "losses": run.losses,
            "ranks": every,
        }
    out["peak_rss_mb"] = _max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def bubble(run: dict, pp: int) -> dict:
    """A pp run's measured bubble per rank (median over the timed steps of ``1 - compute / schedule step``,
    and of the P2P waits' share) against its schedule's formula (module docstring)."""
    layout = run["layout"]
    m, name = layout["pp_microbatches"], layout["pp_schedule"]
    v = 2 if name in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble") else 1
    compute_keys = ("F", "B_full", "B_input", "W", "loss")
    measured, waits, per_call = [], [], defaultdict(list)
    for rank in run["ranks"]:
        steps = rank["parts"]
        measured.append(_median([1 - sum(s.get(k, 0.0) for k in compute_keys) / s["schedule"] for s in steps]))
        waits.append(_median([s.get("wait", 0.0) / s["schedule"] for s in steps]))
        for s in steps:
            for key in ("F", "B_full", "B_input", "W"):
                if s.get(f"n_{key}"):
                    per_call[key].append(s[key] / s[f"n_{key}"])
    t = {key: sum(vals) / len(vals) for key, vals in per_call.items()}  # mean seconds per stage call
    if name in ("GPipe", "1F1B"):
        formula, text = (pp - 1) / (m + pp - 1), f"(p-1)/(m+p-1) = {pp - 1}/{m + pp - 1}"
    elif name == "Interleaved1F1B":
        formula, text = (pp - 1) / (v * m + pp - 1), f"(p-1)/(vm+p-1) = {pp - 1}/{v * m + pp - 1}"
    else:
        f, b, w = t.get("F", 0.0), t.get("B_input", 0.0), t.get("W", 0.0)
        idle = (pp - 1) * (f + b - w) if name == "InterleavedZeroBubble" else max(0.0, (pp - 1) * (f + b - 2 * w))
        formula = idle / (idle + v * m * (f + b + w))
        text = "(p-1)(F+B-W) over vm(F+B+W)" if name == "InterleavedZeroBubble" else "(p-1)(F+B-2W) over 2m(F+B+W)"
    return {"p": pp, "m": m, "v": v, "measured": measured, "waits": waits, "formula": formula, "text": text, "t": t}


def markdown(results: dict) -> str:
    lines = [
        (
            f"Llama {MODEL['hidden_size']} hidden x {MODEL['num_hidden_layers']} layers (bench.py's model), "
            f"global batch {GLOBAL_BATCH} x {SEQ} tokens, fp32, {results['steps']} timed steps per run (alternating) "
            f"after {WARMUP} warm-up, 2 ranks, {results['machine']}, torch {results['torch']}, "
            f"load average {results['load']}"
        ),
        "",
        "| run | layout | CPU ms/step/rank | best wall ms | step-1 loss | state MB/rank | step RSS +MB "
        "| saved activations peak MiB (rank 0, 1) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["runs"].items():
        layout = ", ".join(f"{k}={v}" for k, v in r["layout"].items())
        state = max(sum(rank["state"].values()) for rank in r["ranks"]) / 1e6
        saved = ", ".join(f"{rank['saved_peak'] / 2**20:.1f}" for rank in r["ranks"])
        rss = f"{r['step_rss_mb']:.0f}" if r["step_rss_mb"] is not None else "-"
        lines.append(
            f"| {name} | {layout} | {r['median_cpu_s'] * 1e3:.0f} | {r['best_wall_s'] * 1e3:.0f} "
            f"| {r['losses'][0]:.5f} | {state:.2f} | {rss} | {saved} |"
        )
    lines += [
        "",
        "| schedule | p, m, v | bubble measured (rank 0, 1) | P2P wait share (rank 0, 1) | formula | "
        "per stage call ms: F, B (full or input), W |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["runs"].values():
        if "pp" not in r["layout"]:
            continue
        b = r["bubble"]
        times = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(b["t"].items()))
        lines.append(
            f"| {r['layout']['pp_schedule']} | {b['p']}, {b['m']}, {b['v']} "
            f"| {', '.join(f'{x:.3f}' for x in b['measured'])} | {', '.join(f'{x:.3f}' for x in b['waits'])} "
            f"| {b['formula']:.3f}: {b['text']} | {times} |"
        )
    lines.append(f"\npeak RSS per rank {results['peak_rss_mb']:.0f} MB (every run in one process)")
    return "\n".join(lines)


def main() -> None:
    from shardlm.distributed.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=DEFAULT, help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--all", action="store_true", help="every run: all five schedules at pp=2, fsdp2, tp2")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="directory of the JSON results")
    args = parser.parse_args()
    names = list(RUNS) if args.all else [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"error: unknown run {unknown[0]}; choose from {', '.join(RUNS)}")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    start, load = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="shardlm-pp-bench-") as tmp:
        out = spawn(rank_main, 2, write_model(os.path.join(tmp, "llama")), names, args.steps)[0]
    peak = out.pop("peak_rss_mb")
    for r in out.values():
        if "pp" in r["layout"]:
            r["bubble"] = bubble(r, r["layout"]["pp"])
    load = f"{load[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU x{os.cpu_count()}, gloo"
    results = {"steps": args.steps, "machine": machine, "torch": torch.__version__, "load": load, "runs": out}
    results.update(peak_rss_mb=peak, wall_s=time.perf_counter() - start, model=MODEL)
    print(markdown(results))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pipeline-" + time.strftime("%Y%m%d-%H%M%S") + ".json")
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    print(f"\nresults: {path} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
