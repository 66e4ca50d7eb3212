"""The prepared GPU check of issue 28: bf16 training of a ~1B Llama, tokens/s, MFU and peak memory.

Run on a machine with CUDA GPUs (never by the tests; nothing is downloaded: the model is a random init of a
Llama config written here, the tokenizer and corpus are the demo's in ``examples/``)::

    python benchmarks/gpu.py [--steps 30] [--seq 2048] [--batch 4] [--out runs/gpu]

Each layout the visible GPUs allow (tp=1 on one GPU; tp=2 and fsdp=2 with two or more) is trained through
``shardlm train`` with ``train.bf16`` and ``train.compile`` off and on, ``--steps`` steps; the table gives the
median over the logged steps after the first two of ``tokens_per_second`` (all ranks), ``mfu`` (the trainer's
``6 x params x tokens/s`` over the device's dense bf16 peak, ``train/metrics.py``) and the largest
``peak_memory_mb``. ``--small`` shrinks the model to check the script itself on a CPU (no MFU there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "examples" / "tiny-llama"
CORPUS = REPO / "examples" / "data" / "corpus.txt"
BASE = REPO / "examples" / "demo.yaml"  # the demo's config; every key that matters here is set below
# ~1.1B parameters: Llama-2-style widths, GQA, the tokenizer's ids fit the larger vocabulary
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000}  # fmt: skip
SMALL = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}  # fmt: skip


def write_model(path: Path, sizes: dict, seq: int) -> None:
    """The demo's Llama config at ``sizes`` (its tokenizer beside it); shardlm initializes it from the seed."""
    shutil.copytree(TOKENIZER, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config |= sizes | {"max_position_embeddings": max(seq, config["max_position_embeddings"])}
    (path / "config.json").write_text(json.dumps(config, indent=2))


def layouts(gpus: int) -> list[tuple[str, dict]]:
    found = [("tp1", {"tp": 1, "fsdp": 1})]
    if gpus >= 2:
        found += [("tp2", {"tp": 2, "fsdp": 1}), ("fsdp2", {"tp": 1, "fsdp": 2})]
    return found


def train(model: Path, out: Path, parallel: dict, compiled: bool, args) -> list[dict]:
    """One ``shardlm train`` run; its metrics.jsonl records."""
    overrides = [f"parallel.{k}={v}" for k, v in parallel.items()] + [
        f"model={model}", f"data.path={CORPUS}", f"data.seq_len={args.seq}", "data.packing=true",
        f"train.output_dir={out}", "train.overwrite_output_dir=true", f"train.max_steps={args.steps}",
        f"train.per_device_train_batch_size={args.batch}", "train.logging_steps=1", "train.save_steps=0",
        "train.bf16=true", f"train.compile={str(compiled).lower()}", "train.learning_rate=1e-4",
    ]  # fmt: skip
    subprocess.run([sys.executable, "-m", "shardlm.cli", "train", str(BASE), *overrides], check=True)
    with open(out / "metrics.jsonl") as fh:
        return [r for r in map(json.loads, fh) if "tokens_per_second" in r]


def summary(records: list[dict]) -> dict:
    """Medians over the steps after the first two (compiling, warming up), the largest memory peak."""
    steady = records[2:] or records
    row = {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in steady)}
    row["mfu"] = statistics.median(r["mfu"] for r in steady) if all("mfu" in r for r in steady) else None
    row["peak_memory_mb"] = max(r.get("peak_memory_mb", 0) for r in records)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default=None, help="keeps the runs' outputs there (default: a temporary dir)")
    parser.add_argument("--small", action="store_true", help="a tiny model: checks the script on a CPU")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if not gpus and not args.small:
        sys.exit("error: no CUDA device visible; run on a GPU machine (or --small to check the script on a CPU)")
    root = Path(args.out or tempfile.mkdtemp(prefix="shardlm-gpu-"))
    write_model(root / "model", SMALL if args.small else LLAMA_1B, args.seq)
    device = torch.cuda.get_device_name(0) if gpus else "cpu"
    print(f"| layout | compile | tokens/s | MFU | peak MiB | ({device}, bf16, batch {args.batch} x {args.seq}) |")
    print("|---|---|---|---|---|---|")
    for name, parallel in layouts(gpus):
        for compiled in (False, True):
            row = summary(train(root / "model", root / f"{name}-{compiled}", parallel, compiled, args))
            mfu = f"{row['mfu']:.3f}" if row["mfu"] is not None else "-"
            print(f"| {name} | {'on' if compiled else 'off'} | {row['tokens_per_second']:,.0f} | {mfu} | "
                  f"{row['peak_memory_mb']:,.0f} | |", flush=True)  # fmt: skip
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
