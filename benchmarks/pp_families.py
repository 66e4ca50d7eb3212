"""The cells of issue 29's family x layout grid that the test suite leaves out (docs/pipeline.md, "Families and
layouts"), run once against one process: pp=4 with two stages a rank (8 stages, one block each, under
Interleaved1F1B and ZBVZeroBubble, 4 micro-batches) for Qwen3 (sliding-window blocks), Gemma 3 (sliding and full
blocks), GPT-2 (tied embeddings, learned positions), Qwen3-MoE and LoRA on every projection of Llama, each with 8
blocks; and Qwen3-MoE (4 sparse blocks) with its experts split inside each stage at pp=4 x fsdp=2 x ep=2
(8 ranks, GPipe over each data-parallel rank's 2 rows).

    PYTHONPATH=src python benchmarks/pp_families.py [--no-ep]

The models, the rank bodies, the data and the references are the pipeline tests' (``helpers.plain_reference``:
a plain transformers model, mean cross-entropy over the global batch 4, torch's clipping and AdamW;
``test_lora.peft_reference`` for LoRA; ``test_pipeline.eval_runs`` and ``test_pipeline_families.lora_runs``
on the ranks). Prints per cell the largest |dloss| and relative grad_norm difference over the steps and exits 1
unless every loss agrees to 1e-5 and every grad_norm to 1e-4 relative at each of the 5 steps (the suite's
tolerances).
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
STEPS = 5  # the rank bodies' (eval_run, lora_runs)
FAMILIES = ["qwen3_sliding", "gemma3", "gpt2", "qwen3_moe", "lora_llama"]
VIRTUAL = ["pp4_interleaved", "pp4_zbv"]  # test_pipeline_families.LAYOUTS' names
EP = ({"pp": 4, "fsdp": 2, "ep": 2, "pp_schedule": "GPipe", "pp_microbatches": 2}, 1, 2)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_models(root: str) -> dict[str, str]:
    """The suite's families with 8 blocks (Qwen3's last 6 sliding), and Qwen3-MoE with 4 for pp=4 x ep=2."""
    from helpers import write_gemma3, write_model_dir
    from tiny import tiny_config

    sliding = dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)
    paths = {
        "qwen3_sliding": write_model_dir(os.path.join(root, "qwen3"), "qwen3", num_hidden_layers=8, **sliding),
        "gemma3": write_gemma3(os.path.join(root, "gemma3"), blocks=8),
        "gpt2": write_model_dir(os.path.join(root, "gpt2"), "gpt2", n_layer=8),
        "lora_llama": write_model_dir(os.path.join(root, "llama"), "llama", num_hidden_layers=8),
    }
    for name, blocks in (("qwen3_moe", 8), ("qwen3_moe_4", 4)):
        config = tiny_config("qwen3_moe")
        config.num_hidden_layers = blocks
        config.save_pretrained(os.path.join(root, name))
        paths[name] = os.path.join(root, name)
    return paths


def run_cells(paths: dict[str, str], root: str, ep: bool) -> list[tuple[str, str, float, list, list]]:
    """Every cell: (family, layout, wall seconds of its world, its steps, the reference's)."""
    from helpers import make_adapter, plain_reference
    from test_lora import peft_reference
    from test_pipeline import eval_runs
    from test_pipeline_families import LAYOUTS, lora_runs

    from shardlm.distributed.launch import spawn

    plain = [name for name in FAMILIES if name != "lora_llama"]
    cells = [(name, layout) for name in plain for layout in VIRTUAL]
    start = time.perf_counter()
    got = spawn(eval_runs, 4, [(paths[name], *LAYOUTS[layout]) for name, layout in cells])[0]
    wall = time.perf_counter() - start
    refs = {name: plain_reference(paths[name], GLOBAL_BATCH, STEPS) for name in plain}
    rows = [(name, layout, wall, run[0], refs[name]) for (name, layout), run in zip(cells, got, strict=True)]
    adapter = make_adapter(paths["lora_llama"], os.path.join(root, "adapter"), LORA_TARGETS)
    start = time.perf_counter()
    lora = spawn(lora_runs, 4, paths["lora_llama"], adapter, VIRTUAL)[0]
    wall = time.perf_counter() - start
    ref = peft_reference(paths["lora_llama"], adapter, STEPS)[0]
    rows += [("lora_llama", layout, wall, run, ref) for layout, run in zip(VIRTUAL, lora, strict=True)]
    if ep:
        start = time.perf_counter()
        (run,) = spawn(eval_runs, 8, [(paths["qwen3_moe_4"], *EP)])[0]
        ref = plain_reference(paths["qwen3_moe_4"], GLOBAL_BATCH, STEPS)
        rows.append(("qwen3_moe", "pp4_fsdp2_ep2 (GPipe)", time.perf_counter() - start, run[0], ref))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-ep", action="store_true", help="leave out the 8-rank pp=4 x fsdp=2 x ep=2 run")
    args = parser.parse_args()
    sys.path[:0] = [TESTS, SCRIPTS]  # the spawned ranks import the rank bodies from there too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, SCRIPTS, os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as root:
        rows = run_cells(write_models(root), root, not args.no_ep)
    print(f"fp32, global batch {GLOBAL_BATCH}, {STEPS} steps, helpers.token_dataset's 16-token rows\n")
    print("| family | layout | max \\|dloss\\| | max grad_norm rel. diff | world's wall |")
    print("|---|---|---|---|---|")
    ok = True
    for name, layout, wall, got, ref in rows:
        assert len(got) == len(ref) == STEPS, (name, layout, got)
        ok &= all(abs(a - b) <= 1e-5 * abs(b) and abs(c - d) <= 1e-4 * abs(d) for (a, c), (b, d) in zip(got, ref))
        dloss = max(abs(a - b) for (a, _), (b, _) in zip(got, ref, strict=True))
        dnorm = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, ref, strict=True))
        print(f"| {name} | {layout} | {dloss:.1e} | {dnorm:.1e} | {wall:.0f} s |")
    print("\nall within loss 1e-5, grad_norm 1e-4 relative" if ok else "\nOUT OF TOLERANCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
