"""The optimizer step alone: AdamW over DTensors (torch's, op by op through DTensor dispatch)
against shardlm's ``LocalShardAdamW`` (the same foreach kernels on the local shards).

Per layout, the bench model (``bench.MODEL``) is built by ``parallelize`` and one training step
leaves its gradients; then both optimizers, each with its own state, step the same parameters in
alternation, ``--repeats`` times each, and the median wall time per step of rank 0 is printed.
The numbers are the same (tests/test_optim.py); only the time differs.

    python benchmarks/optim_step.py [--layouts tp2,fsdp2] [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import GLOBAL_BATCH, LAYOUTS, LR, make_dataset, write_model  # noqa: E402


def rank_main(path: str, layout: dict, repeats: int) -> dict:
    import torch.distributed as dist

    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.config import Config, ParallelConfig, TrainConfig
    from shardlm.train.optim import param_groups

    init_distributed()
    par = ParallelConfig(**layout)
    train = TrainConfig(
        output_dir=tempfile.mkdtemp(prefix="optim-"),
        max_steps=100,
        learning_rate=LR,
        per_device_train_batch_size=GLOBAL_BATCH // par.dp_size,
        weight_decay=0.1,
    )
    mesh = build_mesh(par)
    trainer = Trainer(parallelize(path, mesh), Config(model=path, parallel=par, train=train), make_dataset(4), mesh)
    trainer.optimizer.zero_grad = lambda set_to_none=True: None  # keep the step's gradients
    trainer.train_step()
    kw = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, foreach=True)
    optimizers = {
        "dtensor": torch.optim.AdamW(param_groups(trainer.module, 0.1), **kw),
        "local": trainer.optimizer,
    }
    times: dict[str, list[float]] = {k: [] for k in optimizers}
    for i in range(repeats + 2):
        for name, opt in optimizers.items():
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            if i >= 2:  # two warm-up steps (state made on the first)
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    from shardlm.distributed.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="tp2,fsdp2")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(os.path.join(tmp, "llama"))
        for name in args.layouts.split(","):
            _, layout = LAYOUTS[name]
            world = layout.get("tp", 1) * layout.get("fsdp", 1)
            ms = spawn(rank_main, world, path, layout, args.repeats)[0]
            print(
                f"{name}: AdamW step over DTensors {ms['dtensor']:.2f} ms, on local shards {ms['local']:.2f} ms "
                f"({ms['dtensor'] / ms['local']:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
