"""``shardlm`` command line: ``train``, ``plan``, ``consolidate`` and ``estimate``.

Every check that can fail on bad input runs here, before any process is spawned; a
``ConfigError`` becomes one line ``error: ...`` and exit code 2.

Each command imports what it needs inside its function: ``shardlm --help`` and a mistyped
argument answer at once, without importing torch and transformers (seconds).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager

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
    plan.add_argument("--tp", type=int, default=1)
    plan.add_argument("--ep", type=int, default=1, help="expert parallelism: also show the experts per rank")
    plan.add_argument("--pp", type=int, default=1, help="pipeline stages: also show each stage's blocks, parameters")
    plan.add_argument("--pp-microbatches", type=int, default=None, help="micro-batches a step, for the bubble")
    plan.add_argument("--json", action="store_true", help="print only {module: style} as JSON")
    cons = sub.add_parser("consolidate", help="sharded checkpoint -> Hugging Face model directory, verified exactly")
    cons.add_argument("checkpoint", help="a checkpoint step-N directory, or an output_dir (its newest checkpoint)")
    cons.add_argument("out", help="new directory for the Hugging Face model")
    cons.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the written weights")
    cons.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    cons.add_argument("--merge", action="store_true", help="merge LoRA adapters into the base weights")
    est = sub.add_parser("estimate", help="memory per rank of a layout: parameters, gradients, optimizer, activations")
    est.add_argument("model", help="Hugging Face model directory (only config.json is read)")
    est.add_argument("--tp", type=int, default=1)
    est.add_argument("--fsdp", type=int, default=1)
    est.add_argument("--dp-replicate", type=int, default=1)
    est.add_argument("--ep", type=int, default=1, help="expert parallelism (carved out of the data-parallel ranks)")
    est.add_argument("--cp", type=int, default=1, help="context parallelism: each sequence split between cp ranks")
    est.add_argument("--cp-attention", default="all_gather", help="parallel.cp_attention: all_gather or ulysses")
    est.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-step (default 4)")
    est.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128 or the positions)")
    est.add_argument("--bf16", action="store_true", help="mixed precision: bf16 activations, fp32 master state")
    est.add_argument("--lora-r", type=int, default=None, help="LoRA rank: only adapters on q/k/v/o_proj train")
    est.add_argument("--gradient-checkpointing", action="store_true", help="keep only each layer's input")
    est.add_argument("--sequence-parallel", action="store_true", help="parallel.sequence_parallel: norms on slices")
    est.add_argument("--fsdp-offload", action="store_true", help="model state in host memory (fsdp_offload)")
    est.add_argument("--pp", type=int, default=1, help="pipeline stages: each stage's blocks, parameters and peak")
    est.add_argument("--pp-schedule", default="1F1B", help="pipeline schedule, as parallel.pp_schedule (default 1F1B)")
    est.add_argument("--pp-microbatches", type=int, default=None, help="micro-batches of --batch a step (default pp)")
    est.add_argument("--pp-virtual-stages", type=int, default=None, help="stages a rank (default 2 where several)")
    est.add_argument("--memory", type=float, default=None, help="memory per rank in GiB: say whether it fits")
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    """Before spawning: the config, the model-aware checks and the resume checkpoint's bytes, then
    the lock on output_dir and the earlier run's outputs (``checkpoint/ownership.py``); then the ranks."""
    from shardlm.checkpoint.layout import remove_leftovers
    from shardlm.checkpoint.manager import VERIFIED_ENV
    from shardlm.checkpoint.ownership import RUN_ID_ENV, OutputDirLock, claim, new_run_id
    from shardlm.config import load_config
    from shardlm.distributed.launch import checked_on_rank0, under_torchrun
    from shardlm.distributed.mesh import init_distributed
    from shardlm.preflight import check_data, check_run

    cfg = load_config(args.config, args.overrides)
    resume_from = check_run(cfg)  # the model-aware checks and the resume checkpoint: here, not in every rank
    world = cfg.parallel.world_size
    if under_torchrun():
        have = int(os.environ["WORLD_SIZE"])
        if have != world:
            raise ConfigError(f"parallel: pp*dp_replicate*fsdp*cp*tp = {world} but torchrun started {have} processes")
    else:
        nproc = args.nproc or world
        if nproc != world:
            why = f"--nproc {nproc} differs from parallel pp*dp_replicate*fsdp*cp*tp = {world}"
            raise ConfigError(f"{why}; make them equal")
        check_data(cfg)  # tokenizer and data sets, built once here (under torchrun rank 0 builds them)
    verified = {VERIFIED_ENV: os.path.realpath(resume_from)} if resume_from else {}  # the ranks need not hash it again
    t = cfg.train

    def take_over() -> None:
        claim(t.output_dir, resume_from, t.overwrite_output_dir)  # never start fresh over an earlier run
        remove_leftovers(t.output_dir)  # dead .tmp saves (and their space, on a full disk)

    if under_torchrun():  # every rank is its own launcher: no lock (it would be one per rank); rank 0 names the run
        init_distributed(t.timeout_s)
        check_data(cfg)  # collective: rank 0 builds the data sets (data/dataset.py), every rank the same answer
        checked_on_rank0(take_over, t.timeout_s)
        with _environment(verified):
            return _run_ranks(cfg, world)
    run_id = new_run_id()
    with OutputDirLock(t.output_dir, run_id), _environment({RUN_ID_ENV: run_id, **verified}):
        take_over()
        return _run_ranks(cfg, world)


@contextmanager
def _environment(values: dict[str, str]):
    """Set environment variables for the ranks (spawned ranks inherit them), then put them back."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_ranks(cfg, world: int) -> int:
    """The ranks: in this process under torchrun or for one rank, else spawned; the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from shardlm.distributed.launch import RankFailed, spawn, under_torchrun
    from shardlm.distributed.mesh import leave_distributed
    from shardlm.train.faults import NonFiniteError
    from shardlm.train.trainer import run

    try:
        if under_torchrun() or world == 1:
            run(cfg)  # a SIGTERM makes it save and return (faults.py): exit 0
            if under_torchrun():
                leave_distributed()
        else:
            spawn(run, world, cfg)
    except (RankFailed, NonFiniteError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except SignalException as exc:  # SIGINT, SIGHUP, SIGQUIT to the launcher: the ranks were stopped at once
        print(f"error: stopped by {exc.sigval.name}; no checkpoint was saved", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from shardlm.config.paths import check_model_dir
    from shardlm.parallel.infer.autotp import check_geometry, infer_plan
    from shardlm.parallel.infer.refusals import any_block
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.describe import describe_plan
    from shardlm.parallel.runtime.ep import describe_ep

    if min(args.tp, args.ep, args.pp) < 1 or args.tp * args.ep * args.pp < 2:
        raise ConfigError(f"--tp {args.tp} --ep {args.ep} --pp {args.pp}: a plan needs tp, ep or pp >= 2")
    check_model_dir(args.model)  # a local directory: never a hub request
    check_geometry(args.model, args.tp)
    model = build_meta_model(args.model)
    plan = infer_plan(model, args.tp)
    if args.pp > 1 and not args.json:
        print("\n".join(_stage_lines(model, args.pp, args.pp_microbatches or args.pp)))
    if args.ep > 1 and not args.json:
        print("\n".join(describe_ep(model, plan, args.tp, args.ep)))
    if args.tp == 1:
        return 0
    if args.json:
        print(json.dumps(plan.styles, indent=2))
        return 0
    rows = describe_plan(model, plan, args.tp)
    width = max(len(r["module"]) for r in rows)
    print(f"{'module':<{width}}  {'style':<24}  {'global shape':<16}  {'local shape':<16}  {'MB/rank':>8}  source")
    for r in rows:
        shape = lambda d: " ".join("x".join(map(str, s)) for s in d.values())  # noqa: E731
        print(
            f"{r['module']:<{width}}  {r['style']:<24}  {shape(r['global']):<16}  {shape(r['local']):<16}  "
            f"{r['bytes_per_rank'] / 2**20:>8.3f}  {r['source']}"
        )
    total, per_rank = sum(r["bytes_global"] for r in rows), sum(r["bytes_per_rank"] for r in rows)
    print(
        f"total fp32 parameters: {total / 2**20:.3f} MB, per TP rank {per_rank / 2**20:.3f} MB "
        f"({per_rank / total:.3f} of the model at tp={args.tp}; 1/tp = {1 / args.tp:.3f})"
    )
    for fqn, parts in plan.parts.items():
        if fqn in plan.sliced:
            ranks = "; ".join(
                f"rank {r} rows " + " ".join(f"{a}:{b}" for a, b in rows) for r, rows in enumerate(plan.sliced[fqn])
            )
            whole = [p for p, held in zip(parts, plan.whole_parts.get(fqn, [])) if held]
            held = f"; parts {whole} whole on every rank (summed over their split channels)" if whole else ""
            print(f"packed {fqn}: parts {parts}, rows shared by ranks: stored whole on every rank ({ranks}){held}")
        else:
            print(f"packed {fqn}: parts {parts}, each split {args.tp} ways")
    by_reason: dict[str, list[str]] = {}
    for fqn, why in plan.replicated.items():
        by_reason.setdefault(why, []).append(fqn)
    for why, fqns in by_reason.items():
        names = list(dict.fromkeys(any_block(f) for f in fqns))  # one name for every block
        print(f"kept replicated (exact, not split): {', '.join(names)}: {why}")
    inputs = {f"{any_block(m)}({', '.join(map(str, found))})": None for m, found in plan.head_inputs.items()}
    if inputs:  # BLOOM's ALiBi bias, built by the model from the config's head count
        print(f"per-head inputs sliced to each rank's heads (at their global index): {', '.join(inputs)}")
    broadcast = dict.fromkeys(any_block(f) for f in plan.partial_grads)
    if broadcast:  # DiffLlama's lambdas, CPM-Ant's position bias table
        what = "one value for every split head or a per-head table each rank reads its heads' rows of"
        print(f"stored whole ({what}), gradients summed over TP: {', '.join(broadcast)}")
    whole = {
        f"{any_block(m)}.{a}={v}": None
        for m, sizes in plan.local_sizes.items()
        for a, v in sizes.items()
        if getattr(model.get_submodule(m), a, None) == v
    }
    if whole:  # CodeGen's embed_dim: its qkv viewed into the checkpoint's groups; Zaya's CCA hidden_size
        why = "each rank views its columns into whole groups, or sizes a whole input by them"
        print(f"widths kept whole ({why}): {', '.join(whole)}")
    kv, _ = plan.kv_heads
    if kv and kv < args.tp and plan.attention:
        print(
            f"key/value heads replicated: num_key_value_heads={kv} < tp={args.tp}, so rank r reads kv head "
            f"r // {args.tp // kv}; its k/v weights are stored whole on every rank, each rank computes the rows of "
            f"its kv head, and their gradients are summed over TP (joining the one all-reduce per step of "
            f"TP-partial gradients)"
        )
    return 0


def _stage_lines(model, pp: int, microbatches: int) -> list[str]:
    """``plan --pp``: the blocks and parameters of each stage as the ranks cut them (``infer/stages.py``,
    balanced by ``plan/stages.py``), the micro-batches each holds in flight and the bubble per schedule."""
    from shardlm.estimate.stages import SCHEDULES, bubble, check_microbatches, microbatches_in_flight
    from shardlm.parallel.infer.stages import stage_layout

    check_microbatches(pp, "GPipe", microbatches)
    layout = stage_layout(model, pp)
    schedules = [name for name in SCHEDULES if name != "1F1B" or microbatches >= pp]
    lines = [
        f"{pp} pipeline stages of {layout.blocks}, {microbatches} micro-batches a step (in flight: the "
        "micro-batches whose activations a stage holds at once)",
        f"{'stage':<5}  {'blocks':<9}  {'parameters':>12}  " + "  ".join(f"{n + ' in flight':>16}" for n in schedules),
    ]
    for stage, blocks in enumerate(layout.split.blocks):
        held = "  ".join(f"{microbatches_in_flight(n, stage, pp, microbatches):>16}" for n in schedules)
        extra = "  + embedding" if stage == 0 else "  + final norm, head" if stage == pp - 1 else ""
        ends = f"{blocks.start}-{blocks.stop - 1}"
        lines.append(f"{stage:<5}  {ends:<9}  {layout.split.params[stage]:>12,}  {held}{extra}")
    lines.append(f"bubble (p-1)/(m+p-1) = {bubble(pp, microbatches):.3f} of each step under {' and '.join(schedules)}")
    if len(schedules) < len(SCHEDULES):
        lines.append(f"(1F1B needs --pp-microbatches >= {pp})")
    return lines


def cmd_consolidate(args: argparse.Namespace) -> int:
    from shardlm.checkpoint.export import VerificationError, consolidate

    try:
        consolidate(args.checkpoint, args.out, args.dtype, args.max_shard_size, args.merge)
    except VerificationError as exc:
        print(f"error: save correctness check failed: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    import json

    from shardlm.estimate.memory import estimate
    from shardlm.estimate.table import format_table

    est = estimate(
        args.model,
        args.tp,
        args.fsdp,
        args.dp_replicate,
        args.batch,
        args.seq,
        args.bf16,
        args.lora_r,
        args.gradient_checkpointing,
        args.memory,
        args.ep,
        args.sequence_parallel,
        args.fsdp_offload,
        args.cp,
        args.pp,
        args.pp_schedule,
        args.pp_microbatches,
        args.cp_attention,
        args.pp_virtual_stages,
    )
    print(json.dumps(est.to_dict(), indent=2) if args.json else format_table(est))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"train": cmd_train, "plan": cmd_plan, "consolidate": cmd_consolidate, "estimate": cmd_estimate}[
            args.command
        ](args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
