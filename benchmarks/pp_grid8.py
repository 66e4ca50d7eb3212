"""The 8-rank pipeline products of issue 29, run once outside the test suite (8 gloo processes) against one
process: pp=2 x tp=2 x fsdp=2 for Llama (4 blocks, untied) and GPT-2 (4 blocks, tied embeddings across the
first and last stage, learned positions), and Qwen3-MoE (``scripts/tiny.py``'s: 2 sparse blocks, 4 experts)
at pp=2 x fsdp=2 x ep=2 x tp=2 (each stage's 2 fsdp ranks hold 2 experts each, split over its 2 tp ranks).

    PYTHONPATH=src python benchmarks/pp_grid8.py [--steps 3]

The rank body, the data and the one-process reference are the pipeline tests' (``helpers.shardlm_losses``,
``helpers.token_dataset``, ``helpers.plain_reference``: a plain transformers model, mean cross-entropy over
the global batch, torch's clipping and AdamW), so this checks what tests/test_pipeline*.py check at 2 and 4
ranks, at 8. Global batch 4: 1 row a micro-step x 2 micro-steps (the 2 micro-batches of 1F1B) x 2
data-parallel (fsdp) ranks. Prints each step's loss and grad_norm on both sides and their differences, and
exits 1 unless every loss agrees to 1e-5 and every grad_norm to 1e-4 relative (the suite's tolerances).
benchmarks/README.md keeps the measured table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS, SCRIPTS = str(ROOT / "tests"), str(ROOT / "scripts")
GLOBAL_BATCH = 4
# model -> layout (per-device batch 1, accumulation 2 in every run)
RUNS = {
    "llama": {"pp": 2, "tp": 2, "fsdp": 2},
    "gpt2": {"pp": 2, "tp": 2, "fsdp": 2},
    "qwen3_moe": {"pp": 2, "fsdp": 2, "ep": 2, "tp": 2},
}


def write_models(root: str) -> dict[str, str]:
    """The three tiny models, as the pipeline tests write them."""
    from helpers import write_model_dir
    from tiny import tiny_config

    paths = {
        "llama": write_model_dir(os.path.join(root, "llama"), "llama", num_hidden_layers=4),
        "gpt2": write_model_dir(os.path.join(root, "gpt2"), "gpt2", n_layer=4),
    }
    tiny_config("qwen3_moe").save_pretrained(os.path.join(root, "qwen3_moe"))
    paths["qwen3_moe"] = os.path.join(root, "qwen3_moe")
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    sys.path[:0] = [TESTS, SCRIPTS]  # the spawned ranks import the rank body from there too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, SCRIPTS, os.environ.get("PYTHONPATH")) if p)
    from helpers import plain_reference, shardlm_losses

    from shardlm.distributed.launch import spawn

    ok = True
    with tempfile.TemporaryDirectory() as root:
        paths = write_models(root)
        rows = []
        for name, layout in RUNS.items():
            start = time.perf_counter()
            got = spawn(shardlm_losses, 8, [paths[name]], layout, 1, 2, args.steps)[0][paths[name]]
            wall = time.perf_counter() - start
            ref = plain_reference(paths[name], GLOBAL_BATCH, steps=args.steps)
            rows.append((name, layout, wall, got, ref))
        print(f"8 ranks, {SEQ_NOTE}, global batch {GLOBAL_BATCH}, fp32, {args.steps} steps, 1F1B\n")
        print("| model | layout | step | loss (8 ranks) | loss (one process) | |dloss| | grad_norm rel. diff | wall |")
        print("|---|---|---|---|---|---|---|---|")
        for name, layout, wall, got, ref in rows:
            label = " x ".join(f"{k}{v}" for k, v in layout.items())
            for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, ref, strict=True), 1):
                dloss, dnorm = abs(loss - ref_loss), abs(norm - ref_norm) / abs(ref_norm)
                ok &= dloss <= 1e-5 and dnorm <= 1e-4
                cells = f"{loss:.6f} | {ref_loss:.6f} | {dloss:.1e} | {dnorm:.1e}"
                print(f"| {name} | {label} | {i} | {cells} | {wall:.0f} s |")
        print("\nall within loss 1e-5, grad_norm 1e-4 relative" if ok else "\nOUT OF TOLERANCE")
    return 0 if ok else 1


SEQ_NOTE = "helpers.token_dataset's 16-token rows (padded and wholly-ignored samples)"

if __name__ == "__main__":
    sys.exit(main())
