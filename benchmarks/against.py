"""shardlm against its previous commit and against transformers, each side in processes of its own.

Why: ``bench.py`` runs both frameworks inside the same ranks, so anything process-wide (the
allocator's settings, thread counts, a global flag) hits both sides alike and a regression of that
kind never shows there. It did happen: a fixed glibc mmap threshold made every step on CPU a third
slower, in shardlm and in transformers beside it. Here every side gets fresh ranks:

* ``new``: shardlm from this checkout (its ``src/`` copied at the start);
* ``old``: shardlm at ``--against`` (default ``HEAD~1``), its ``src/`` exported with ``git archive``;
* ``transformers``: transformers' own ``DistributedConfig`` in ranks that never import shardlm's
  process setup (``torch.distributed`` joined directly).

Sides alternate round by round (new, old, transformers, new, old, ...) so load from other
processes hits each alike. Per side: CPU ms per step and rank (median over timed steps and
rounds; the number to trust on a shared machine), best tokens/s, and memory: the peak RSS of each
timed step (``VmHWM`` reset before it, nothing trimmed), whose first and last values show creep,
and the peak over the run. Ratios are new over the other side. ``--layouts one,tp2`` adds TP efficiency:
the model in one process on the same cores (all threads; shardlm's sides only) against tp=2.

    python benchmarks/against.py [--against REV] [--layouts tp2,fsdp2] [--steps 6] [--rounds 2] [--sides new,old]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIDES = ("new", "old", "transformers")
# ``one``: the bench Llama in one process on every core (``spawn`` gives it all the threads), shardlm's sides
# only: the reference of TP efficiency (``efficiency``)
ONE = "one"


def _with_peak_rss(step):
    """(``step()``'s result, peak resident MB while it ran): VmHWM reset to the current RSS first (Linux)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    out = step()
    with open("/proc/self/status") as fh:
        return out, next(int(line.split()[1]) for line in fh if line.startswith("VmHWM")) / 1024


def rank_body(side: str, path: str, layout: dict, steps: int) -> dict:
    """One side on this rank: warm-up, then ``steps`` timed steps (CPU s, wall s, peak RSS MB each)."""
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    import bench

    if side == "transformers":
        dist.init_process_group("gloo")
        run = bench.TransformersRun(path, layout, bench.make_dataset(steps + bench.WARMUP))
    else:
        from shardlm import init_distributed

        init_distributed()
        run = bench.ShardlmRun(path, layout, bench.make_dataset(steps + bench.WARMUP))
    for _ in range(bench.WARMUP):
        run.step()
    cpu, wall, rss = [], [], []
    for _ in range(steps):
        (step_wall, step_cpu), peak = _with_peak_rss(lambda: bench._timed(run.step))
        rss.append(bench._max_over_ranks(peak))
        wall.append(step_wall)
        cpu.append(step_cpu)
    return {"cpu_s": cpu, "wall_s": wall, "step_peak_rss_mb": rss, "loss": run.losses[0]}


def _side_main(spec: str) -> None:
    """In a subprocess whose ``PYTHONPATH`` picks the side's shardlm: spawn the ranks, print JSON."""
    a = json.loads(spec)
    from shardlm.distributed.launch import spawn

    world = a["layout"].get("tp", 1) * a["layout"].get("fsdp", 1)
    print("RESULT " + json.dumps(spawn(rank_body, world, a["side"], a["path"], a["layout"], a["steps"])[0]))


def export_src(rev: str, into: str) -> str:
    """``src/`` of ``rev`` written under ``into`` (no worktree, nothing else touched)."""
    os.makedirs(into, exist_ok=True)
    archive = os.path.join(into, "src.tar")
    subprocess.run(["git", "-C", REPO, "archive", "-o", archive, rev, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return os.path.join(into, "src")


def run_side(side: str, src: str, path: str, layout: dict, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    spec = json.dumps({"side": side, "path": path, "layout": layout, "steps": steps})
    proc = subprocess.run(
        [sys.executable, __file__, "--side", spec], env=env, capture_output=True, text=True, check=False
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"error: side {side} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(line[len("RESULT ") :])


def summary(runs: list[dict]) -> dict:
    cpu = [c for r in runs for c in r["cpu_s"]]
    wall = [w for r in runs for w in r["wall_s"]]
    rss = [r["step_peak_rss_mb"] for r in runs]
    return {
        "median_cpu_ms": statistics.median(cpu) * 1e3,
        "best_wall_ms": min(wall) * 1e3,
        "median_wall_ms": statistics.median(wall) * 1e3,
        "first_step_rss_mb": statistics.median(r[0] for r in rss),
        "last_step_rss_mb": statistics.median(r[-1] for r in rss),
        "peak_rss_mb": max(max(r) for r in rss),
        "loss": runs[0]["loss"],
    }


def main() -> None:
    sys.path.insert(0, HERE)
    import bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD~1", help="the commit to compare with (default HEAD~1)")
    parser.add_argument("--layouts", default="tp2,fsdp2,tp2_fsdp2", help="subset of bench.py's dense layouts")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of new, old, transformers")
    parser.add_argument("--sides", default=",".join(SIDES), help="a subset of new,old,transformers")
    parser.add_argument("--hidden", type=int, default=bench.MODEL["hidden_size"], help="the Llama's width")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return _side_main(args.side)
    names = [n for n in args.layouts.split(",") if n]
    sides = [s for s in SIDES if s in args.sides.split(",")]
    if "new" not in sides:
        sys.exit(f"error: --sides {args.sides}: needs new (the ratios are over it), e.g. new,old")
    layouts = {**bench.LAYOUTS, ONE: ("llama", {})}
    if any(layouts.get(n, ("",))[0] != "llama" for n in names):
        sys.exit(f"error: --layouts takes {', '.join(n for n, v in layouts.items() if v[0] == 'llama')}")
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", args.against], capture_output=True, text=True)
    if rev.returncode:
        sys.exit(f"error: --against {args.against}: not a commit of {REPO}")
    bench.MODEL["hidden_size"] = args.hidden
    bench.MODEL["intermediate_size"] = args.hidden * 688 // 256
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    start = time.perf_counter()
    results: dict = {"against": rev.stdout.strip(), "model": dict(bench.MODEL), "steps": args.steps, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="shardlm-against-") as tmp:
        # a copy of this checkout's src/: editing the tree while the bench runs changes nothing
        new = shutil.copytree(os.path.join(REPO, "src"), os.path.join(tmp, "new", "src"))
        srcs = {"new": new, "old": export_src(args.against, os.path.join(tmp, "old")), "transformers": ""}
        path = bench.write_model(os.path.join(tmp, "llama"))
        for name in names:
            layout = layouts[name][1]
            runs: dict[str, list[dict]] = {s: [] for s in sides if name != ONE or s != "transformers"}
            for _ in range(args.rounds):
                for side in runs:
                    runs[side].append(run_side(side, srcs[side] or srcs["new"], path, layout, args.steps))
            results["layouts"][name] = {s: summary(r) for s, r in runs.items()}
    results["wall_s"] = time.perf_counter() - start
    print(markdown(results))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    out = os.path.join(HERE, "results", "against-" + time.strftime("%Y%m%d-%H%M%S") + ".json")
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"\nresults: {out} ({results['wall_s']:.0f} s)")


def markdown(results: dict) -> str:
    m = results["model"]
    lines = [
        f"Llama {m['hidden_size']} hidden x {m['num_hidden_layers']} layers, fp32, each side in its own ranks, "
        f"{results['steps']} timed steps per side and round; old = {results['against']}. CPU ratio: the other "
        "side's median CPU ms over new's (above 1: new is faster).",
        "",
        "| layout | side | CPU ms/step/rank | CPU ratio | best wall ms | step peak RSS MB, first -> last "
        "| peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, sides in results["layouts"].items():
        new = sides["new"]["median_cpu_ms"]
        for side, s in sides.items():
            ratio = "" if side == "new" else f"{s['median_cpu_ms'] / new:.2f}x"
            lines.append(
                f"| {name} | {side} | {s['median_cpu_ms']:.0f} | {ratio} | {s['best_wall_ms']:.0f} "
                f"| {s['first_step_rss_mb']:.0f} -> {s['last_step_rss_mb']:.0f} | {s['peak_rss_mb']:.0f} |"
            )
    return "\n".join(lines + efficiency(results["layouts"]))


def efficiency(layouts: dict) -> list[str]:
    """TP efficiency against one process on the same cores, per side run in both: tokens/s at tp=2 over one
    process's (best wall), and one process's CPU time over the two ranks' (median CPU ms x 2)."""
    if ONE not in layouts or "tp2" not in layouts:
        return []
    lines = [""]
    for side, one in layouts[ONE].items():
        tp2 = layouts["tp2"][side]
        wall = one["best_wall_ms"] / tp2["best_wall_ms"]
        cpu = one["median_cpu_ms"] / (2 * tp2["median_cpu_ms"])
        lines.append(f"TP efficiency ({side}): tokens/s {wall:.2f} of one process's (best wall), CPU {cpu:.2f}")
    return lines


if __name__ == "__main__":
    main()
