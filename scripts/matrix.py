"""The compatibility matrix: every causal-LM model type of the installed transformers, at tp=2.

For each type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (transformers' list, not ours), a tiny
random model is built from the type's own config defaults, sizes shrunk (``scripts/tiny.py``),
dropout off. Recorded per type:

* build: the model trains one step in one process (else the exception class: not ours to fix);
* plan: ``infer_plan`` at tp=2 made (with the sub-blocks kept replicated), refused (the
  one-line ``error:``), or an exception (a bug: the plan must never raise anything else);
* tp=2 parity: 3 steps of shardlm at tp=2 against the plain one-process loop of
  ``tests/helpers.py`` (max relative difference of loss and grad_norm), models batched into few
  spawns; a spawn that dies or hangs is cut off and the rest run in a new one (the model it was
  on is marked only when the spawn finished none);
* tp=2 x fsdp=2 parity for a subset (one 4-rank spawn);
* with ``--sizes equal,unequal``: each type again at the second size set of issue 27 (unequal widths:
  ``scripts/tiny.py: SIZE_SETS``), build, plan and tp=2, in a column of its own.

Writes ``docs/compatibility.md`` and ``docs/compatibility.json``. ``make matrix`` runs it;
``--types a,b`` limits it to some types (the output is then not written unless ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests"), str(REPO / "src")]
STEPS = 3
TOL = (1e-5, 1e-4)  # loss, grad_norm relative: the tolerances of tests/test_autotp.py
FSDP_SUBSET = [
    "gpt2", "llama", "bloom", "codegen", "falcon", "gpt_bigcode", "lfm2", "qwen3", "gemma3_text", "opt",
    "gpt_oss", "mpt",  # attention split with its per-head sinks, ALiBi (tests/test_attention_split.py)
    "qwen3_next", "olmo_hybrid", "lfm3",  # mixers split by heads (parallel/infer/channels.py)
    "jamba", "mamba", "falcon_mamba",  # Mamba-1 mixers split by channels (parallel/infer/summed.py)
    "mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h",  # Mamba-2 mixers (n_groups=1 < tp: B, C whole)
    "zamba2", "deepseek_v4", "jetmoe", "blt", "reformer", "trocr",  # attention split in issue 27's last rounds
    "zamba",  # a shared transformer called by several hybrid layers: its own FSDP group
    "big_bird",  # its attention built again in the forward, localized then (parallel/plan/local_geometry.py)
    "inkling2_text", "inkling2_loop_text",  # full attention's dynamic conv taps [kernel, channels] split along dim 1
    "zaya",  # its value projections stored by the rows each rank computes (``shards.RowsShard``): FSDP chunks them
    "xlnet",  # attention of einsums of per-head parameters, split by heads (parallel/infer/head_einsums.py)
    "qwen4_exp_text", "qwen4_exp",  # the QSA indexer's query heads split, scores summed before its top-k
]  # fmt: skip
CHUNK_TIMEOUT_S = 420


class _Timeout(BaseException):
    """Not an Exception: shardlm's plan turns any Exception while tracing into a refusal."""


def _alarm(seconds: int):
    def handler(signum, frame):
        raise _Timeout(f"over {seconds} s")

    signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)


def _group(model_type: str, model, refusal: str | None) -> str:
    from transformers.models.auto import modeling_auto as ma

    names = {type(m).__name__ for m in model.modules()}
    if refusal and "mixture-of-experts" in refusal:
        return "MoE"
    if any(s in n for n in names for s in ("Moe", "MoE", "Expert")):
        return "MoE"
    config = model.config
    if any(getattr(config, k, None) is not None for k in ("vision_config", "audio_config", "text_config")) or (
        model_type in getattr(ma, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})
    ):
        return "multimodal"
    hybrid = ("Mamba", "ShortConv", "DeltaNet", "Rwkv", "Rglru", "Recurrent", "Ssm", "SSM", "xLSTM", "Mlstm", "Conv")
    if any(s in n for n in names for s in hybrid if n != "Conv1D"):
        return "hybrid/SSM"
    if (
        model_type in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
        or model_type in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ):
        return "encoder-decoder decoders"
    return "dense decoder-only"


def _quiet() -> None:
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def data_vocab(path: str) -> int:
    """The token ids a model at ``path`` (``<root>/<type>/<size set>/model``) is trained on: ``[0, 64)`` (the
    tests' ``token_dataset``) at the first size set, as before; its whole vocabulary at the others, so that an
    odd one's last TP rank, holding fewer rows (issue 27), holds targets too."""
    if Path(path).parent.name == "equal":
        return 64
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    return (config.get("text_config") or config).get("vocab_size") or config.get("vocab_size") or 64


def survey(model_type: str, root: str, sizes: str = "equal") -> dict:
    """Build, train one step in one process, plan at tp=2; reference losses when a plan is made; the tiny
    config of the size set ``sizes`` (``scripts/tiny.py: SIZE_SETS``)."""
    import torch
    from helpers import plain_reference
    from tiny import tiny_config

    from shardlm.errors import ConfigError
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.kept_whole import attention_bytes, kept_whole

    row = {"type": model_type}
    path = os.path.join(root, model_type.replace("/", "_"), sizes, "model")
    try:
        _alarm(90)
        config = tiny_config(model_type, sizes)
        os.makedirs(path, exist_ok=True)
        config.save_pretrained(path)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        ids = torch.randint(0, 64, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
    except (Exception, _Timeout) as exc:  # noqa: BLE001 - recorded: the type does not build at tiny sizes
        signal.alarm(0)
        why = " ".join(str(exc).split())  # a NotBuildable reason (scripts/tiny.py) whole, else its start
        row.update(build=f"{type(exc).__name__}: {why if type(exc).__name__ == 'NotBuildable' else why[:100]}")
        row["group"] = "(does not build)"
        return row
    row["build"] = "ok"
    try:
        _alarm(300)  # the plan's own time (HRM's nested recurrent loops take a while on shared cores)
        plan = infer_plan(build_meta_model(path), 2)
        row["plan"] = "made"
        row["replicated"] = sorted({w for w in plan.replicated.values()})[:2]
        row["n_replicated"] = len(plan.replicated)
        row["n_split"] = sum(s in ("colwise", "rowwise", "packed_colwise") for s in plan.styles.values())
        meta = build_meta_model(path)
        row["kept_whole"] = kept_whole(plan, meta)
        row["attention_bytes"] = attention_bytes(meta, plan, 2)  # (per rank, whole)
        row["attention_bytes_ran"] = attention_bytes(meta, plan, 2, ran=True)  # of those run on text rows
    except ConfigError as exc:
        row["plan"] = "refused"
        row["refusal"] = f"error: {exc}"
    except (Exception, _Timeout) as exc:  # noqa: BLE001 - a bug in shardlm: recorded with its class
        row["plan"] = "error"
        row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        row["traceback"] = traceback.format_exc(limit=-3)
    finally:
        signal.alarm(0)
    row["group"] = _group(model_type, model, row.get("refusal"))
    if row["plan"] == "made":
        try:
            _alarm(120)
            # under shardlm's dropout mode: dropout is off, but a router's random draws (Phi-MoE's
            # sampling) are keyed as shardlm's ranks draw them (parallel/runtime/dropout.py)
            row["reference"] = plain_reference(path, 4, steps=STEPS, dropout=True, vocab=data_vocab(path))
            row["path"] = path
        except (Exception, _Timeout) as exc:  # noqa: BLE001
            row["plan_note"] = f"reference failed: {type(exc).__name__}"
        finally:
            signal.alarm(0)
    return row


def rank_body(paths: list[str], layout: dict, per_device: int, results: str) -> None:
    """One spawn, many models: each trains ``STEPS`` steps; rank 0 appends a JSON line per model
    (so a chunk that dies or hangs still leaves what finished)."""
    import torch.distributed as dist
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    for path in paths:
        try:
            cfg = train_config(path, layout, per_device, 1, STEPS)
            mesh = build_mesh(cfg.parallel)
            model = parallelize(path, mesh, seed=cfg.train.seed)
            history = Trainer(model, cfg, token_dataset(vocab=data_vocab(path)), mesh).train()
            out = {"path": path, "losses": [(h["loss"], h["grad_norm"]) for h in history]}
        except Exception as exc:  # noqa: BLE001 - recorded per model
            out = {"path": path, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"}
        if dist.get_rank() == 0:
            with open(results, "a") as fh:
                fh.write(json.dumps(out) + "\n")


def run_chunks(paths: list[str], layout: dict, per_device: int, workdir: str) -> dict:
    """Run ``paths`` in as few spawns as possible; a spawn cut off by its timeout marks the model
    it was on and the rest start again in a new spawn."""
    results: dict[str, dict] = {}
    todo = list(paths)
    name = "x".join(f"{k}{v}" for k, v in layout.items())
    while todo:
        out = os.path.join(workdir, f"{name}_{len(results)}.jsonl")
        args = json.dumps({"paths": todo, "layout": layout, "per_device": per_device, "results": out})
        cmd = [sys.executable, __file__, "--rank-chunk", args]
        try:
            subprocess.run(cmd, timeout=CHUNK_TIMEOUT_S, capture_output=True, start_new_session=True)
            why = "the spawn failed"
        except subprocess.TimeoutExpired:
            why = f"no result within the chunk's {CHUNK_TIMEOUT_S} s"
        done = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
        for r in done:
            results[r["path"]] = r
        todo = [p for p in todo if p not in results]
        if todo and not done:  # a chunk that finished models was only slow (shared cores): go on
            results[todo[0]] = {"path": todo[0], "error": why}
            todo = todo[1:]
    return results


def _rel(got: list, ref: list) -> tuple[float, float]:
    loss = max(abs(a[0] - b[0]) / max(abs(b[0]), 1e-12) for a, b in zip(got, ref))
    norm = max(abs(a[1] - b[1]) / max(abs(b[1]), 1e-12) for a, b in zip(got, ref))
    return loss, norm


def _parity(row: dict, result: dict | None) -> dict:
    if result is None:
        return {}
    if "error" in result:
        return {"status": "error", "detail": result["error"]}
    loss, norm = _rel(result["losses"], row["reference"])
    ok = loss <= TOL[0] and norm <= TOL[1] and len(result["losses"]) == STEPS
    return {"status": "parity" if ok else "MISMATCH", "loss_rel": loss, "grad_norm_rel": norm}


GROUPS = ["dense decoder-only", "encoder-decoder decoders", "hybrid/SSM", "multimodal", "MoE", "(does not build)"]


def write_docs(rows: list[dict], seconds: float, out_dir: Path, rerun: list[str] = ()) -> None:
    """compatibility.json and .md in ``out_dir`` from ``rows``; ``rerun``: the types whose rows came from a later
    run of their own (``--merge``), named in the text."""
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    clean = [{k: v for k, v in r.items() if k not in ("reference", "path", "traceback")} for r in rows]
    counts = _counts(rows)
    weights = _weights_cells(out_dir / "published_weights.json")
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "seconds": round(seconds), **counts}
    if rerun:
        meta["rerun"] = sorted(rerun)
    (out_dir / "compatibility.json").write_text(json.dumps({"meta": meta, "rows": clean}, indent=1) + "\n")
    rerun_note = f" Rows rerun after that run, each type's on its own (`--merge`): {', '.join(rerun)}." if rerun else ""
    lines = [
        "# Compatibility matrix (generated by `make matrix`, `scripts/matrix.py`)",
        "",
        f"Every causal-LM model type of transformers {transformers.__version__} "
        f"(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {len(rows)} types), as a tiny random model built from the "
        "type's own config defaults with only the sizes shrunk and dropout off. **plan**: `shardlm plan --tp 2` "
        "made a plan (`k/n`: k linears kept replicated of n), or refused with one line. **tp=2**: 3 training steps "
        "against one process (max relative difference of loss and grad_norm; parity means <= 1e-5 and 1e-4). "
        f"**tp2 x fsdp2**: the same on 4 ranks, for a subset. **kept whole**: the attention's parameter bytes "
        "per rank over the whole model's at tp=2 (1/tp = 0.500 where all of it is split; then, where they differ, "
        "of the attention the text rows run, not a tower's), and what the plan stores whole on every rank and why "
        "(`parallel/plan/kept_whole.py`; empty in rows from before it). A column "
        "named after another size set (`--sizes`, `scripts/tiny.py: SIZE_SETS`; `unequal`: 8 heads, 4 kv heads, "
        "hidden 96, intermediate 160, vocabulary 253, split 127 and 126 rows, trained on ids over all of it; "
        "`unequal_even`: the same with vocabulary 254, the second set while a vocabulary tp does not divide was "
        "refused) holds that set's tp=2 result, else "
        f"its plan or build cell. Took {seconds / 60:.1f} min on {os.cpu_count()} CPU cores.{rerun_note}",
        "",
        f"Counts: {counts['built']} build at tiny sizes; of them {counts['parity']} train at tp=2 with parity, "
        f"{counts['refused']} are refused with one line, {counts['mismatch']} mismatch, {counts['run_error']} fail "
        f"in training at tp=2, {counts['plan_error']} raise in the plan.",
        *_other_counts(rows),
        "",
        "**published weights** (types with checkpoint conversion rules; `scripts/published_sweep.py`, "
        "[published_weights.md](published_weights.md)): a checkpoint `save_pretrained` writes in the published "
        "layout loads exactly through transformers' rules (in-memory tensors read by renamed key / as boxes / "
        "whole), and is written back as the same files.",
        "",
    ]
    others = sorted({k.removeprefix("sizes_") for r in rows for k in r if k.startswith("sizes_")})
    for group in GROUPS:
        members = [r for r in rows if r.get("group") == group]
        if not members:
            continue
        extra = "".join(f" {name} sizes |" for name in others)
        lines += [
            f"## {group} ({len(members)})",
            "",
            f"| model type | plan | tp=2 | tp2 x fsdp2 | kept whole | published weights |{extra}",
            "|---|---|---|---|---|---|" + "---|" * len(others),
        ]
        for r in sorted(members, key=lambda r: r["type"]):
            cells = "".join(f" {_size_set_cell(r.get(f'sizes_{name}'))} |" for name in others)
            lines.append(
                f"| {r['type']} | {_plan_cell(r)} | {_run_cell(r.get('tp2'))} | {_run_cell(r.get('tp2_fsdp2'))} "
                f"| {_whole_cell(r)} | {weights.get(r['type'], '')} |{cells}"
            )
        lines.append("")
    (out_dir / "compatibility.md").write_text("\n".join(lines))


def _weights_cells(path: Path) -> dict[str, str]:
    """``{model type: cell}`` from ``scripts/published_sweep.py``'s JSON, if it was run."""
    if not path.is_file():
        return {}
    cells = {}
    for r in json.loads(path.read_text()):
        read = ", ".join(f"{k} {v}" for k, v in sorted(r.get("read", {}).items()))
        detail = f": `{r['detail']}`" if r.get("detail") else ""
        back = f"; written back: {r['write_back']}" if r.get("write_back") else ""
        cells[r["type"]] = (f"{r['status']}{detail}" + (f" ({read})" if read else "") + back).replace("|", "\\|")
    return cells


def _plan_cell(r: dict) -> str:
    if r["build"] != "ok":
        return f"does not build: `{r['build']}`"
    if r["plan"] == "made":
        note = (
            f" ({r['n_replicated']}/{r['n_replicated'] + r['n_split']} replicated: {r['replicated'][0]})"
            if r.get("n_replicated")
            else ""
        )
        return ("made" + note).replace("|", "\\|")
    if r["plan"] == "refused":
        return f"refused: `{r['refusal']}`".replace("|", "\\|")
    return f"**ERROR** `{r['error']}`".replace("|", "\\|")


def _whole_cell(r: dict) -> str:
    """The attention's parameter bytes per rank against the whole at tp=2 (next to 1/tp), and what the
    plan stores whole on every rank and why (``plan/kept_whole.py``); empty for rows of an older run."""
    if "attention_bytes" not in r:
        return ""
    local, whole = r["attention_bytes"]
    share = f"attention {local / whole:.3f} per rank (1/tp = 0.500)" if whole else "no attention"
    ran_local, ran_whole = r.get("attention_bytes_ran", (local, whole))
    ran_share = f"{ran_local / ran_whole:.3f}" if ran_whole else ""
    if ran_share and ran_share != f"{local / whole:.3f}":  # a tower or a cross-attention never run, kept whole
        share = share.replace(")", f"; {ran_share} of the attention run on text rows)")
    return "; ".join([share, *r["kept_whole"]]).replace("|", "\\|")


def _size_set_cell(r: dict | None) -> str:
    """Another size set's row in one cell: its tp=2 result where it has a plan, else its plan cell."""
    if not r:
        return ""
    if r["build"] == "ok" and r["plan"] == "made" and r.get("tp2"):
        note = f" ({r['n_replicated']}/{r['n_replicated'] + r['n_split']} replicated)" if r.get("n_replicated") else ""
        return _run_cell(r["tp2"]) + note
    return _plan_cell(r)


def _run_cell(p: dict | None) -> str:
    if not p:
        return ""
    if p["status"] == "error":
        return f"error: `{p['detail']}`".replace("|", "\\|")
    return f"{p['status']} ({p['loss_rel']:.1e}, {p['grad_norm_rel']:.1e})"


def _other_counts(rows: list[dict]) -> list[str]:
    """One counts line for each further size set (its cells are the rows' ``sizes_<name>`` entries)."""
    names = sorted({k.removeprefix("sizes_") for r in rows for k in r if k.startswith("sizes_")})
    lines = []
    for name in names:
        c = _counts([r[f"sizes_{name}"] for r in rows if f"sizes_{name}" in r])
        lines.append(
            f"At the `{name}` sizes: {c['built']} build; of them {c['parity']} train at tp=2 with parity, "
            f"{c['refused']} are refused with one line, {c['mismatch']} mismatch, {c['run_error']} fail in training, "
            f"{c['plan_error']} raise in the plan."
        )
    return [""] + lines if lines else []


def _counts(rows: list[dict]) -> dict:
    built = [r for r in rows if r["build"] == "ok"]
    status = [r.get("tp2", {}).get("status") for r in built]
    return {
        "types": len(rows),
        "built": len(built),
        "parity": status.count("parity"),
        "mismatch": status.count("MISMATCH"),
        "run_error": status.count("error"),
        "refused": sum(r["plan"] == "refused" for r in built),
        "plan_error": sum(r["plan"] == "error" for r in built),
    }


def run_size_set(types: list[str], workdir: str, sizes: str, jobs: int, fsdp: bool) -> list[dict]:
    """Every type at the size set ``sizes``: surveyed (``survey``), then trained at tp=2 (and at
    tp=2 x fsdp=2 for ``FSDP_SUBSET`` with ``fsdp``) against its one-process reference."""
    from concurrent.futures import ProcessPoolExecutor

    rows = []
    with ProcessPoolExecutor(jobs, initializer=_quiet) as pool:  # one process each: imports dominate
        for t, r in zip(types, pool.map(survey, types, [workdir] * len(types), [sizes] * len(types))):
            rows.append(r)
            print(f"{sizes} {t:28s} build={r['build'][:30]:30s} plan={r.get('plan', '-')}", flush=True)
    planned = {r["path"]: r for r in rows if r.get("path")}
    tp2 = run_chunks(list(planned), {"tp": 2}, 4, workdir)
    for path, r in planned.items():
        r["tp2"] = _parity(r, tp2.get(path))
        print(f"{sizes} tp=2 {r['type']:28s} {r['tp2']}", flush=True)
    if fsdp:
        subset = [p for p, r in planned.items() if r["type"] in FSDP_SUBSET and r["tp2"].get("status") == "parity"]
        both = run_chunks(subset, {"tp": 2, "fsdp": 2}, 2, workdir)
        for path in subset:
            planned[path]["tp2_fsdp2"] = _parity(planned[path], both.get(path))
            print(f"{sizes} tp2xfsdp2 {planned[path]['type']:28s} {planned[path]['tp2_fsdp2']}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: all causal-LM types)")
    parser.add_argument("--out", help="directory for compatibility.md/json (default docs/, only for a full run)")
    parser.add_argument("--no-fsdp", action="store_true", help="skip the tp2 x fsdp2 runs")
    parser.add_argument("--jobs", type=int, default=2, help="processes building and planning models (default 2)")
    parser.add_argument(
        "--sizes",
        default="equal",
        help="size sets of scripts/tiny.py (SIZE_SETS), comma-separated: the first makes the rows, each other "
        "one a column of its own (build, plan, tp=2): 'equal,unequal' for issue 27's two, as make matrix "
        "runs (default equal)",
    )
    parser.add_argument(
        "--merge",
        help="comma-separated output directories of runs of some --types: their rows replace those in docs/ "
        "(compatibility.json), which is rewritten with the types named as rerun; the full run is not repeated",
    )
    parser.add_argument("--rank-chunk", help=argparse.SUPPRESS)
    parser.add_argument(
        "--docs-only", action="store_true", help="rewrite compatibility.md from the JSON files in docs/"
    )
    args = parser.parse_args()
    if args.docs_only or args.merge:  # e.g. after scripts/published_sweep.py: the matrix itself is not rerun
        saved = json.loads((REPO / "docs" / "compatibility.json").read_text())
        rows, rerun = saved["rows"], set(saved["meta"].get("rerun", ()))
        for out in args.merge.split(",") if args.merge else ():
            new = {r["type"]: r for r in json.loads((Path(out) / "compatibility.json").read_text())["rows"]}
            rows = [new.get(r["type"], r) for r in rows]
            rerun |= new.keys()
        write_docs(rows, saved["meta"]["seconds"], REPO / "docs", sorted(rerun))
        return
    if args.rank_chunk:
        from shardlm.distributed.launch import spawn

        a = json.loads(args.rank_chunk)
        world = a["layout"].get("tp", 1) * a["layout"].get("fsdp", 1)
        spawn(rank_body, world, a["paths"], a["layout"], a["per_device"], a["results"])
        return
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    types = args.types.split(",") if args.types else list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    start = time.time()
    workdir = tempfile.mkdtemp(prefix="shardlm-matrix-")
    first, *others = args.sizes.split(",")
    rows = run_size_set(types, workdir, first, args.jobs, not args.no_fsdp)
    for sizes in others:  # the other size sets: build, plan and tp=2 only, a column each
        for row, other in zip(rows, run_size_set(types, workdir, sizes, args.jobs, False)):
            row[f"sizes_{sizes}"] = {k: v for k, v in other.items() if k not in ("reference", "path", "traceback")}
    seconds = time.time() - start
    print(json.dumps(_counts(rows)), f"{seconds / 60:.1f} min")
    out = args.out or (None if args.types else str(REPO / "docs"))
    if out:
        write_docs(rows, seconds, Path(out))


if __name__ == "__main__":
    main()
