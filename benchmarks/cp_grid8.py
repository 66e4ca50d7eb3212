"""The 8-rank grid of issue 26, run once outside the test suite: tp=2 x cp=2 x fsdp=2 (8 gloo processes)
against one process, for Llama, Qwen3 and Gemma 3 (a sliding-window layer, window 64), on
document-packed windows of 512 tokens; Llama also with ``parallel.sequence_parallel``.

    PYTHONPATH=src python benchmarks/cp_grid8.py [--steps 3]

The jobs, the windows, the tiny models and the one-process reference are ``tests/test_context_parallel.py``'s
(``cp_runs``, ``cp_data``, ``write_family``, ``plain``: a plain transformers model, mean cross-entropy,
torch's clipping and AdamW), so this checks the same thing as the suite's 4-rank grid, at 8 ranks. Global
batch 4: 1 sample a micro-step x 2 micro-steps x 2 data-parallel (fsdp) ranks. Prints each step's loss and
grad_norm on both sides and their differences, and exits 1 unless every loss agrees to 1e-5 and every
grad_norm to 1e-4 relative (the suite's tolerances). benchmarks/README.md keeps the measured table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1] / "tests")
GRID = {"tp": 2, "cp": 2, "fsdp": 2}
FAMILIES = ["llama", "qwen3", "gemma3"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, TESTS)  # the spawned ranks import the rank body from there too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    from test_context_parallel import cp_data, cp_runs, plain, write_family

    from shardlm.distributed.launch import spawn

    with tempfile.TemporaryDirectory() as root:
        paths = {f: write_family(os.path.join(root, f), f) for f in FAMILIES}
        jobs = [(paths[f], GRID, 1, 2, True, {"steps": args.steps}) for f in FAMILIES]
        jobs.append((paths["llama"], {**GRID, "sequence_parallel": True}, 1, 2, True, {"steps": args.steps}))
        start = time.perf_counter()
        got = spawn(cp_runs, 8, jobs, os.path.join(root, "out"))[0]
        wall = time.perf_counter() - start
        ok = True
        print(f"8 ranks ({wall:.0f} s for all jobs), packed windows of 512 tokens, global batch 4, fp32\n")
        print("| model | layout | step | loss (8 ranks) | loss (one process) | |dloss| | grad_norm rel. diff |")
        print("|---|---|---|---|---|---|---|")
        for (path, layout, *_), steps in zip(jobs, got):
            ref = plain(path, cp_data(True), steps=args.steps)
            name = "x".join(f"{k}{v}" for k, v in layout.items() if k != "sequence_parallel")
            name += " + SP" if layout.get("sequence_parallel") else ""
            for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, ref), 1):
                dloss, dnorm = abs(loss - ref_loss), abs(norm - ref_norm) / abs(ref_norm)
                ok &= dloss <= 1e-5 and dnorm <= 1e-4
                family = os.path.basename(path)
                print(f"| {family} | {name} | {i} | {loss:.6f} | {ref_loss:.6f} | {dloss:.1e} | {dnorm:.1e} |")
        print("\nall within loss 1e-5, grad_norm 1e-4 relative" if ok else "\nOUT OF TOLERANCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
