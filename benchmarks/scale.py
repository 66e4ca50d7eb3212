"""``make bench-scale``: models one step up from the tests, measured against ``shardlm estimate``.

Why: ``shardlm estimate`` exists to answer "will it fit" before a launch, and a checkpoint save
must not be what runs out of memory. Per configuration, the ranks load a Llama from one
safetensors file (written once, seeded, under ``benchmarks/results/scale/``), train a few steps
and save; each rank records its resident memory:

* *baseline*: RSS right after joining the process group (torch, transformers, gloo), before any
  tensor: the ``+ runtime`` line of the estimate, not part of its total;
* *step peak*: the peak RSS of each training step (VmHWM reset before it) minus the baseline, the max
  over ranks; compared with the estimate's total;
* *save peak*: the peak RSS after the save; the save must stay within one tensor of the step peak;
* step time (the median), save and load MB/s (checkpoint bytes over wall time, all ranks at once).

    python benchmarks/scale.py [--configs 349m_tp2_fsdp2,...] [--steps 3]

Prints a Markdown table and writes the numbers to ``benchmarks/results/scale-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {  # Llama shapes (GQA); the 349M one is the model of the scale issue
    "160m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048),
    "349m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=2816),
}  # fmt: skip
CONFIGS = {  # name: (model, layout, per-rank batch, seq, bf16, train overrides; lora_r: a LoRA run)
    "349m_tp2_fsdp2": ("349m", {"tp": 2, "fsdp": 2}, 1, 256, False, {}),
    "160m_tp2": ("160m", {"tp": 2}, 2, 256, False, {}),
    "349m_fsdp2_ckpt": ("349m", {"fsdp": 2}, 2, 256, False, {"gradient_checkpointing": True}),
    "349m_tp2_fsdp2_lora_bf16": ("349m", {"tp": 2, "fsdp": 2}, 1, 256, True, {"lora_r": 16}),
}


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb(reset: bool = False) -> float:
    """Peak RSS since the last reset (VmHWM; ``reset`` first sets it to the current RSS, Linux).
    getrusage's ru_maxrss reads the same counter, so once reset it is no longer the run's peak."""
    if reset:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM")) / 1024


def model_dir(name: str) -> str:
    """The model's directory with seeded weights in one safetensors file (written once)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = os.path.join(HERE, "results", "scale", name)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        config = LlamaConfig(vocab_size=32000, max_position_embeddings=512, **MODELS[name])
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).float().save_pretrained(path, max_shard_size="20GB")
    return path


def rank_body(path: str, layout: dict, batch: int, seq: int, bf16: bool, extra: dict, steps: int, out: str) -> dict:
    import torch
    import torch.distributed as dist

    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.config import Config, DataConfig, LoraConfig, ParallelConfig, TrainConfig
    from shardlm.data.dataset import TokenDataset
    from shardlm.train.trainer import mixed_precision_policy

    init_distributed()
    baseline = rss_mb()
    extra = dict(extra)
    lora = (
        LoraConfig(r=extra.pop("lora_r"), target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        if "lora_r" in extra
        else None
    )
    train = TrainConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, save_steps=0, bf16=bf16, **extra
    )
    cfg = Config(model=path, data=DataConfig(seq_len=seq), parallel=ParallelConfig(**layout), train=train, lora=lora)
    mesh = build_mesh(cfg.parallel)
    frozen = torch.bfloat16 if lora is not None and bf16 else None
    model = parallelize(
        path, mesh, seed=0, mp_policy=mixed_precision_policy(train), lora_config=lora, frozen_dtype=frozen
    )
    gen = torch.Generator().manual_seed(0)  # the same samples on every rank (TP ranks check it)
    ids = torch.randint(0, model.module.config.vocab_size, (batch * mesh.parallel.dp_size * steps, seq), generator=gen)
    trainer = Trainer(model, cfg, TokenDataset(ids, ids.clone()), mesh)
    times, step_peaks = [], [peak_mb()]  # the first entry: building and loading the model
    for _ in range(steps):
        peak_mb(reset=True)
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        step_peaks.append(peak_mb())
    step_peak = max(step_peaks)
    dist.barrier()
    peak_mb(reset=True)
    start = time.perf_counter()
    step_dir = trainer.save_checkpoint()
    save_s = time.perf_counter() - start
    save_peak = max(peak_mb(), step_peak)
    dist.barrier()
    start = time.perf_counter()
    trainer.load_checkpoint(step_dir)
    load_s = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step_dir) for f in fs)
    largest = max(p.numel() * p.element_size() for p in model.module.parameters()) / 2**20
    return {
        "baseline_mb": baseline,
        "step_peak_mb": step_peak - baseline,
        "step_peaks_mb": [p - baseline for p in step_peaks[1:]],
        "save_peak_mb": save_peak - baseline,
        "step_s": statistics.median(times),
        "save_mb_s": size / 2**20 / save_s,
        "load_mb_s": size / 2**20 / load_s,
        "largest_tensor_mb": largest,
    }


def run(name: str, steps: int) -> dict:
    from shardlm.distributed.launch import spawn
    from shardlm.estimate.memory import estimate

    model, layout, batch, seq, bf16, extra = CONFIGS[name]
    path = model_dir(model)
    out = os.path.join(HERE, "results", "scale", f"run-{name}")
    world = layout.get("tp", 1) * layout.get("fsdp", 1)
    ranks = spawn(rank_body, world, path, layout, batch, seq, bf16, extra, steps, out)
    est = estimate(path, **layout, batch=batch, seq=seq, bf16=bf16, **extra)
    worst = max(ranks.values(), key=lambda r: r["step_peak_mb"])
    return {
        "config": name,
        "params": est.params_full,
        "estimate_mb": est.bytes["total"] / 2**20,
        "measured_mb": worst["step_peak_mb"],
        "error": est.bytes["total"] / 2**20 / worst["step_peak_mb"] - 1,
        "save_over_step_mb": max(r["save_peak_mb"] - r["step_peak_mb"] for r in ranks.values()),
        **{
            k: worst[k]
            for k in ("baseline_mb", "step_peaks_mb", "step_s", "save_mb_s", "load_mb_s", "largest_tensor_mb")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = [run(name, args.steps) for name in args.configs.split(",")]
    print("| config | params | estimate MiB | measured MiB | error | baseline MiB | save over step peak MiB "
          "| largest tensor MiB | step s | save MB/s | load MB/s | peak MiB of each step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['params'] / 1e6:.0f}M | {r['estimate_mb']:.0f} | {r['measured_mb']:.0f} | "
            f"{r['error']:+.1%} | {r['baseline_mb']:.0f} | {r['save_over_step_mb']:.1f} | "
            f"{r['largest_tensor_mb']:.0f} | {r['step_s']:.1f} | {r['save_mb_s']:.0f} | {r['load_mb_s']:.0f} | "
            f"{', '.join(f'{p:.0f}' for p in r['step_peaks_mb'])} |"
        )
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"scale-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
