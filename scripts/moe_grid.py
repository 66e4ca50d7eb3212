"""The MoE grid of issue 12: six families x four layouts, resumes across layouts, consolidation.

``tests/test_moe.py`` and ``tests/test_ep_training.py`` cover a subset (CI time); this script runs
the whole grid and writes ``docs/moe_grid.md`` and ``docs/moe_grid.json`` (``make moe-grid``).

Families: Mixtral, Qwen3-MoE, Qwen2-MoE (shared expert), OLMoE, gpt-oss (expert biases, sinks) and
DeepSeek-V3 (MLA, shared experts, grouped routing), each a tiny model from its own config defaults,
sizes shrunk (``scripts/tiny.py``, as the tests use). Layouts (2 ranks: tp=2, ep=2 alone
(= dp_replicate=2 x ep=2), fsdp=2 x ep=2; 4 ranks: tp=2 x ep=2 (= tp=2 x dp_replicate=2 x ep=2)),
global batch 4, fp32, dropout off, 5 steps, against the plain one-process loop of
``tests/helpers.py`` (``plain_reference``): the largest relative difference of loss and grad_norm
(the issue's bar: 1e-5 and 1e-4), the collectives of one micro-batch (``model_collectives``) and
the bytes of the experts' 3-D parameters per rank. A layout refused before spawning records its
one-line ``error:`` (the same checks ``shardlm train`` makes); one that fails records its
exception; neither stops the grid.

Resumes: the fsdp=2 x ep=2 run saves at step 2 and is resumed at fsdp=2 (ep=1); the tp=2 run saves
at step 2 and is resumed at tp=2 x ep=2 (4 ranks); the resumed losses (steps 3-5) against the
uninterrupted run's (1e-5). Reload: ``shardlm consolidate`` of the fsdp=2 x ep=2 run's last
checkpoint, read by ``from_pretrained`` (no missing or unexpected keys) and compared bit for bit
with the DCP checkpoint's weights.

The rank bodies run on the pooled processes of ``tests/pool.py`` (one set of 2 and one of 4
processes for the whole grid; one job per family and layout, so a failure costs only its cell).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests"), str(REPO / "src")]

FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss", "deepseek_v3"]
# name -> (parallel layout, world size); global batch GLOBAL: per_device = GLOBAL / dp ranks
LAYOUTS = {
    "tp2": ({"tp": 2}, 2),
    "ep2": ({"dp_replicate": 2, "ep": 2}, 2),
    "fsdp2_ep2": ({"fsdp": 2, "ep": 2}, 2),
    "tp2_ep2": ({"tp": 2, "dp_replicate": 2, "ep": 2}, 4),
}
# resume name -> (saved by layout, resumed at layout, world size)
RESUMES = {
    "ep2_to_ep1": ("fsdp2_ep2", {"fsdp": 2}, 2),
    "tp2_to_tp2_ep2": ("tp2", LAYOUTS["tp2_ep2"][0], 4),
}
GLOBAL, STEPS, SAVE_AT = 4, 5, 2
TOL = {"loss": 1e-5, "grad_norm": 1e-4, "resume": 1e-5}
JOB_TIMEOUT_S = 300


def _label(layout: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in layout.items())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


# ---------------------------------------------------------------- rank bodies


def _expert_bytes(model) -> tuple[int, int]:
    """(bytes of the experts' 3-D parameters on this rank, in the whole model), fp32: as
    ``tests/test_moe.py``'s helpers, over the EP experts (``expert_grads``) or else the TP plan's."""
    names = model.expert_grads or [
        f"{fqn}.{name}" for fqn in model.plan.experts for name, _ in model.module.get_submodule(fqn).named_parameters()
    ]
    params = [p for p in map(model.module.get_parameter, names) if p.dim() == 3]
    local = sum(4 * (p.to_local().numel() if hasattr(p, "to_local") else p.numel()) for p in params)
    return local, sum(4 * p.numel() for p in params)


def _train(path: str, layout: dict, out: str, steps: int, **train) -> list[tuple[float, float]]:
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.config import ParallelConfig

    init_distributed()
    per_device = GLOBAL // ParallelConfig(**layout).dp_size
    cfg = train_config(path, layout, per_device, 1, steps, output_dir=out, **train)
    mesh = build_mesh(cfg.parallel)
    model = parallelize(path, mesh, seed=cfg.train.seed)
    return [(h["loss"], h["grad_norm"]) for h in Trainer(model, cfg, token_dataset(), mesh).train()]


def layout_body(path: str, layout: dict, out: str) -> dict:
    """Rank body: 5 steps at ``layout`` (checkpoints at step 2 and the last), then the collectives
    of one micro-batch and the experts' bytes per rank of a fresh model at that layout."""
    from helpers import model_collectives

    from shardlm import build_mesh, parallelize
    from shardlm.config import ParallelConfig

    steps = _train(path, layout, out, STEPS, save_steps=SAVE_AT)
    mesh = build_mesh(ParallelConfig(**layout))
    model = parallelize(path, mesh)
    return {"steps": steps, "collectives": model_collectives(model, mesh), "experts_bytes": _expert_bytes(model)}


def resume_body(path: str, layout: dict, out: str, checkpoint: str) -> list[float]:
    """Rank body: resume ``checkpoint`` at ``layout`` and train to step 5; the losses logged."""
    return [loss for loss, _ in _train(path, layout, out, STEPS, resume=checkpoint)]


# ---------------------------------------------------------------- one process


def _rel(got: list, ref: list) -> dict:
    return {
        "loss": max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, ref, strict=True)),
        "grad_norm": max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got, ref, strict=True)),
    }


def refusal(path: str, layout: dict, data: str) -> str | None:
    """The one-line ``error:`` ``shardlm train`` would print before spawning, if any."""
    from helpers import load_checked

    from shardlm import ConfigError

    try:
        load_checked(raw={"model": path, "data": {"path": data}, "parallel": layout})
    except ConfigError as exc:
        return f"error: {exc}"
    return None


def reload_check(step_dir: str, out: str) -> dict:
    """``shardlm consolidate`` of ``step_dir`` into ``out``, read back by ``from_pretrained``:
    missing/unexpected keys, and every tensor of the DCP checkpoint's model compared with the
    loaded model's (parameters and persistent buffers), bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardlm.checkpoint.export import consolidate
    from shardlm.checkpoint.io import load_dcp, read_metadata

    consolidate(step_dir, out)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    meta = read_metadata(step_dir).state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("model.")}
    load_dcp(state, step_dir, no_dist=True)
    params = model.state_dict()  # parameters and persistent buffers (DeepSeek-V3's e_score_correction_bias)
    compared = [k[len("model.") :] for k in state if k[len("model.") :] in params]
    differ = [k for k in compared if not torch.equal(params[k], state[f"model.{k}"])]
    absent = sorted(k[len("model.") :] for k in state if k[len("model.") :] not in params)
    return {
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "compared": len(compared),
        "differ": differ,
        "dcp_not_in_model": absent,
        "ok": not (info["missing_keys"] or info["unexpected_keys"] or differ or absent) and bool(compared),
    }


def run_family(model_type: str, root: Path, data: str, log) -> dict:
    """Every cell of one family's row (a failure is recorded in its cell, never raised)."""
    from helpers import plain_reference, run_ranks
    from tiny import tiny_config

    row: dict = {"layouts": {}, "resumes": {}, "reload": None}
    path = str(root / model_type)
    try:
        tiny_config(model_type).save_pretrained(path)
        ref = plain_reference(path, GLOBAL, STEPS)
    except Exception as exc:  # noqa: BLE001 - recorded: the family has no reference, nothing to compare
        row["error"] = f"one-process reference: {_first_line(exc)}"
        return row
    row["reference"] = ref
    runs = {}
    for name, (layout, world) in LAYOUTS.items():
        cell: dict = {"layout": _label(layout)}
        row["layouts"][name] = cell
        cell["refused"] = refusal(path, layout, data)
        if cell["refused"]:
            continue
        start = time.time()
        try:
            got = run_ranks(layout_body, world, path, layout, str(root / model_type / name))
        except Exception as exc:  # noqa: BLE001 - recorded in the cell
            cell["failed"] = _first_line(exc)
            continue
        runs[name] = got["steps"]
        rel = _rel(got["steps"], ref)
        cell.update(
            steps=got["steps"],
            rel=rel,
            ok=rel["loss"] <= TOL["loss"] and rel["grad_norm"] <= TOL["grad_norm"],
            collectives=got["collectives"],
            experts_bytes=got["experts_bytes"],
            seconds=round(time.time() - start, 1),
        )
        log(f"{model_type} {name}: loss {rel['loss']:.1e} grad_norm {rel['grad_norm']:.1e} ({cell['seconds']} s)")
    for name, (saved_by, layout, world) in RESUMES.items():
        cell = {"from": LAYOUTS[saved_by][0], "to": layout}
        row["resumes"][name] = cell
        if saved_by not in runs:
            cell["skipped"] = f"no {saved_by} run to resume"
            continue
        cell["refused"] = refusal(path, layout, data)
        if cell["refused"]:
            continue
        checkpoint = str(root / model_type / saved_by / "checkpoints" / f"step-{SAVE_AT}")
        try:
            losses = run_ranks(resume_body, world, path, layout, str(root / model_type / name), checkpoint)
        except Exception as exc:  # noqa: BLE001 - recorded in the cell
            cell["failed"] = _first_line(exc)
            continue
        full = [loss for loss, _ in runs[saved_by][SAVE_AT:]]
        cell["losses"], cell["uninterrupted"] = losses, full
        cell["rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, full)) if len(losses) == len(full) else None
        cell["ok"] = cell["rel"] is not None and cell["rel"] <= TOL["resume"]
        log(f"{model_type} {name}: resumed losses {cell['rel']}")
    if "fsdp2_ep2" in runs:
        step_dir = str(root / model_type / "fsdp2_ep2" / "checkpoints" / f"step-{STEPS}")
        try:
            row["reload"] = reload_check(step_dir, str(root / model_type / "hf"))
        except Exception as exc:  # noqa: BLE001 - recorded in the cell
            row["reload"] = {"ok": False, "failed": _first_line(exc)}
        log(f"{model_type} reload: {row['reload'].get('ok')}")
    return row


# ---------------------------------------------------------------- the documents


def _counts_text(counts: list[dict]) -> str:
    """``fwd all_to_all_single 6, all_reduce 5; bwd ...`` (phases without collectives left out)."""
    parts = []
    for phase, c in zip(("fwd", "loss", "bwd", "grads"), counts):
        if c:
            parts.append(f"{phase} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    return "; ".join(parts) or "none"


def _layout_cell(cell: dict) -> str:
    if cell.get("refused"):
        return f"refused: `{cell['refused']}`"
    if cell.get("failed"):
        return f"**failed**: `{cell['failed']}`"
    mark = "ok" if cell["ok"] else "**over tolerance**"
    return f"{mark} {cell['rel']['loss']:.1e} / {cell['rel']['grad_norm']:.1e}"


def _resume_cell(cell: dict) -> str:
    if cell.get("skipped"):
        return f"skipped ({cell['skipped']})"
    if cell.get("refused"):
        return f"refused: `{cell['refused']}`"
    if cell.get("failed"):
        return f"**failed**: `{cell['failed']}`"
    rel = "-" if cell["rel"] is None else f"{cell['rel']:.1e}"
    return f"{'ok' if cell['ok'] else '**differs**'} {rel}"


def _reload_cell(r: dict | None) -> str:
    if r is None:
        return "no fsdp=2 x ep=2 checkpoint"
    if r.get("failed"):
        return f"**failed**: `{r['failed']}`"
    if r["ok"]:
        return f"ok: {r['compared']} tensors equal, none missing/unexpected"
    return (
        f"**differs**: missing {r['missing'][:3]}, unexpected {r['unexpected'][:3]}, "
        f"unequal {r['differ'][:3]}, not in model {r['dcp_not_in_model'][:3]}"
    )


def render(rows: dict, seconds: float, versions: dict) -> str:
    names = list(LAYOUTS)
    lines = [
        "# MoE grid (issue 12)",
        "",
        "Generated by `scripts/moe_grid.py` (`make moe-grid`); do not edit by hand. "
        f"{len(rows)} families, tiny models from each family's config defaults (sizes shrunk), "
        f"fp32, dropout off, {STEPS} steps, global batch {GLOBAL}, against one process "
        "(`tests/helpers.py::plain_reference`). "
        f"Run time {seconds:.0f} s; {', '.join(f'{k} {v}' for k, v in versions.items())}.",
        "",
        f"## Parity: max relative difference, loss / grad_norm (bar: {TOL['loss']:g} / {TOL['grad_norm']:g})",
        "",
        "Resumes: the resumed run's losses (steps 3-5, checkpoint of step 2) against the uninterrupted "
        f"run's, max relative difference (bar {TOL['resume']:g}). Reload: `shardlm consolidate` of the "
        "fsdp=2 x ep=2 run's last checkpoint read by `from_pretrained`, every tensor of the checkpoint "
        "equal to the loaded model's (parameters and persistent buffers), bit for bit.",
        "",
        "| family | "
        + " | ".join(_label(LAYOUTS[n][0]) for n in names)
        + " | resume ep=2 -> ep=1 | resume tp=2 -> tp=2 x ep=2 | consolidate + reload |",
        "|" + "---|" * (len(names) + 4),
    ]
    for family, row in rows.items():
        if row.get("error"):
            lines.append(f"| {family} | **failed**: `{row['error']}` |" + " |" * (len(names) + 2))
            continue
        cells = [_layout_cell(row["layouts"][n]) for n in names]
        cells += [_resume_cell(row["resumes"][n]) for n in RESUMES] + [_reload_cell(row["reload"])]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Collectives per micro-batch and experts' bytes per rank",
        "",
        "One micro-batch (2 x 8 tokens) of a fresh model at the layout (`tests/helpers.py::model_collectives`): "
        "forward, loss, backward, and the trainer's sum of TP-partial gradients. Experts: bytes of the "
        "experts' 3-D parameters on one rank, of the whole model's (fp32).",
        "",
        "| family | layout | collectives | experts bytes per rank |",
        "|---|---|---|---|",
    ]
    for family, row in rows.items():
        for n in names:
            cell = row["layouts"].get(n)
            if cell and "collectives" in cell:
                local, whole = cell["experts_bytes"]
                lines.append(
                    f"| {family} | {cell['layout']} | {_counts_text(cell['collectives'])} | {local} of {whole} |"
                )
    return "\n".join(lines) + "\n"


def write_docs(rows: dict, seconds: float, out_dir: Path, versions: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"seconds": round(seconds), "versions": versions, "tolerances": TOL, "families": rows}
    (out_dir / "moe_grid.json").write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    (out_dir / "moe_grid.md").write_text(render(rows, seconds, versions))


def main() -> None:
    import pool
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated subset (the docs are then written only with --out)")
    parser.add_argument("--out", type=Path, help="where to write moe_grid.md/.json (default: docs/)")
    args = parser.parse_args()
    families = args.families.split(",") if args.families else FAMILIES
    out = args.out or (None if args.families else REPO / "docs")
    pool.JOB_TIMEOUT_S = JOB_TIMEOUT_S
    start, rows = time.time(), {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "data.txt").write_text("hello world\n")
            for family in families:
                rows[family] = run_family(family, root, str(root / "data.txt"), lambda m: print(m, flush=True))
    finally:
        pool.shutdown()
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if out is not None:
        write_docs(rows, time.time() - start, out, versions)
        print(f"wrote {out / 'moe_grid.md'}")
    else:
        print(render(rows, time.time() - start, versions))


if __name__ == "__main__":
    main()
