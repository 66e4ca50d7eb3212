"""``train.compile`` on and off: the bench model's step at tp2 (or another bench layout).

Each setting in ranks of its own (compiled code lives in the process), 3 warm-up steps (the first
runs eagerly, the second compiles), then ``--steps`` timed steps: best wall (slowest rank) and
median CPU time per rank, and the loss of each step (they must agree).

    python benchmarks/compile_step.py [--layout tp2] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import GLOBAL_BATCH, LAYOUTS, LR, MAX_NORM, _timed, make_dataset, write_model  # noqa: E402

WARMUP = 3


def rank_main(path: str, layout: dict, steps: int, compile_: bool) -> dict:
    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.config import Config, ParallelConfig, TrainConfig

    init_distributed()
    par = ParallelConfig(**layout)
    train = TrainConfig(
        output_dir=tempfile.mkdtemp(prefix="compile-"),
        max_steps=100,
        learning_rate=LR,
        per_device_train_batch_size=GLOBAL_BATCH // par.dp_size,
        lr_scheduler_type="constant",
        max_grad_norm=MAX_NORM,
        compile=compile_,
    )
    mesh = build_mesh(par)
    cfg = Config(model=path, parallel=par, train=train)
    trainer = Trainer(parallelize(path, mesh), cfg, make_dataset(steps + WARMUP), mesh)
    losses = []
    for _ in range(WARMUP):
        losses.append(trainer.train_step()["loss"])
    timed = []
    for _ in range(steps):
        timed.append(_timed(lambda: losses.append(trainer.train_step()["loss"])))
    return {
        "wall_ms": 1e3 * min(w for w, _ in timed),
        "cpu_ms": 1e3 * statistics.median(c for _, c in timed),
        "losses": losses,
    }


def main() -> None:
    from shardlm.distributed.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="tp2")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _, layout = LAYOUTS[args.layout]
    world = layout.get("tp", 1) * layout.get("fsdp", 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(os.path.join(tmp, "llama"))
        for compile_ in (False, True):
            r = spawn(rank_main, world, path, layout, args.steps, compile_)[0]
            losses = " ".join(f"{x:.5f}" for x in r["losses"])
            print(
                f"{args.layout} compile={compile_}: best {r['wall_ms']:.0f} ms wall, "
                f"median CPU {r['cpu_ms']:.0f} ms/rank; losses {losses}",
                flush=True,
            )


if __name__ == "__main__":
    main()
