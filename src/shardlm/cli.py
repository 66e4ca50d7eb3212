"""``shardlm`` command line: ``train``, ``plan`` and ``consolidate``.

Every check that can fail on bad input runs here, before any process is spawned; a
``ConfigError`` becomes one line ``error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from shardlm.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardlm", description="Train Hugging Face causal LMs with TP x FSDP2.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a YAML config")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides, e.g. parallel.tp=2")
    train.add_argument("--nproc", type=int, default=None, help="local processes (default tp*fsdp*dp_replicate)")
    plan = sub.add_parser("plan", help="print the tensor-parallel plan of a model")
    plan.add_argument("model", help="Hugging Face model directory")
    plan.add_argument("--tp", type=int, required=True)
    plan.add_argument("--json", action="store_true", help="print only {module: style} as JSON")
    cons = sub.add_parser("consolidate", help="sharded checkpoint -> Hugging Face model directory, verified exactly")
    cons.add_argument("checkpoint", help="a checkpoint step-N directory, or an output_dir (its newest checkpoint)")
    cons.add_argument("out", help="new directory for the Hugging Face model")
    cons.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the written weights")
    cons.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    cons.add_argument("--merge", action="store_true", help="merge LoRA adapters into the base weights")
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    import os

    from shardlm.config import load_config
    from shardlm.launch import RankFailed, spawn, under_torchrun
    from shardlm.trainer import run

    cfg = load_config(args.config, args.overrides)
    from shardlm.checkpoint import precheck_resume

    precheck_resume(cfg)  # a checkpoint that cannot be resumed fails here, not in every rank
    world = cfg.parallel.world_size
    if under_torchrun():
        have = int(os.environ["WORLD_SIZE"])
        if have != world:
            raise ConfigError(f"parallel: dp_replicate*fsdp*tp = {world} but torchrun started {have} processes")
        run(cfg)
        return 0
    nproc = args.nproc or world
    if nproc != world:
        raise ConfigError(f"--nproc {nproc} differs from parallel dp_replicate*fsdp*tp = {world}; make them equal")
    if nproc == 1:
        run(cfg)
        return 0
    try:
        spawn(run, nproc, cfg)
    except RankFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from shardlm.parallelize import build_meta_model
    from shardlm.plan import check_geometry, infer_tp_plan

    check_geometry(args.model, args.tp)
    plan = infer_tp_plan(build_meta_model(args.model), args.tp)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        width = max((len(k) for k in plan), default=10)
        for fqn, style in plan.items():
            print(f"{fqn:<{width}}  {style}")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from shardlm.consolidate import VerificationError, consolidate

    try:
        consolidate(args.checkpoint, args.out, args.dtype, args.max_shard_size, args.merge)
    except VerificationError as exc:
        print(f"error: save correctness check failed: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"train": cmd_train, "plan": cmd_plan, "consolidate": cmd_consolidate}[args.command](args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
