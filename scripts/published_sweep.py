"""Published weights, every causal-LM model type with conversion rules: load and write back.

For each type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose tiny model (``scripts/tiny.py``) has
checkpoint conversion rules in the installed transformers (``get_model_conversion_mapping``, the
legacy renamings left out), one process, no spawn:

* write the model with ``save_pretrained`` in the published layout (``_weight_conversions`` set
  as ``from_pretrained`` leaves it on a model loaded from that layout, so prefix changes are
  written too);
* map the files' names through the rules (``published.check``): how many tensors are read by a
  rename, by boxes, whole;
* load them with ``published.load`` into a fresh model and compare every tensor, bit for bit,
  with the model that was saved;
* write them back as consolidation does (``published_write.PublishedUnpack``, tensor by tensor) and
  compare names, shapes and bits with the files ``save_pretrained`` wrote.

Writes ``docs/published_weights.md`` and ``.json``; ``--types a,b`` limits it (then nothing is
written unless ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests"), str(REPO / "src")]


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:140]}"


def sweep(model_type: str, root: str) -> dict | None:
    import torch
    from safetensors.torch import load_file
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping

    from shardlm.parallel.build import _retie, _shared_parameters
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.weights import published, published_write
    from shardlm.parallel.weights.fill import _base_state

    row: dict = {"type": model_type}
    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
    except Exception as exc:  # noqa: BLE001 - does not build at tiny sizes: listed if its type has rules
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES

        if not (get_checkpoint_conversion_mapping(NAMES[model_type]) or get_checkpoint_conversion_mapping(model_type)):
            return None
        return {**row, "status": "does not build", "detail": _short(exc)}
    rules = get_model_conversion_mapping(model, add_legacy=False)
    if not rules:
        return None
    row["rules"] = sorted({type(r).__name__ for r in rules})
    row["ops"] = sorted({"+".join(type(o).__name__ for o in r.operations) for r in rules if hasattr(r, "operations")})
    path = os.path.join(root, model_type)
    try:
        model._weight_conversions = rules
        try:
            model.save_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - transformers' own reverse fails at tiny sizes: not ours
            return {**row, "status": "save_pretrained fails", "detail": _short(exc)}
        files = {}
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                files.update(load_file(os.path.join(path, name)))
        layout = published.check(path, build_meta_model(path))
        row["read"] = published.describe(layout)
        row["rules_used"] = len(layout.used)
        fresh = build_meta_model(path)
        shared = _shared_parameters(fresh)
        fresh.to_empty(device="cpu")
        _retie(shared)  # as parallelize does: tied weights stay one tensor
        state = _base_state(fresh)
        published.load(state, path, build_meta_model(path))
        saved = model.state_dict()
        bad = [k for k, v in state.items() if not torch.equal(v, saved[k])]
        if bad:
            return {**row, "status": "load differs", "detail": bad[0]}
        hf = os.path.join(root, model_type + "-hf")
        os.makedirs(hf)
        shutil.copy(os.path.join(path, "config.json"), hf)
        published_write.record_layout(path, hf, build_meta_model(path))

        def read(members: dict) -> None:  # what consolidation reads from the checkpoint
            for key, tensor in members.items():
                tensor.copy_(state[key[len("model.") :]])

        unpack = published_write.PublishedUnpack(hf, build_meta_model(hf), lambda n, t: {n: t}, read)
        written = {}
        for key, tensor in state.items():
            written.update(unpack(key, tensor))
        if written.keys() != files.keys():
            diff = sorted(written.keys() ^ files.keys())
            row["write_back"] = f"other names: {diff[0]} (and {len(diff) - 1} more)"
        else:
            same = all(torch.equal(written[k], files[k].float()) for k in files)
            row["write_back"] = "same files" if same else "other values"
        row["status"] = "loads"
    except Exception as exc:  # noqa: BLE001 - recorded
        row.update(status="fails", detail=_short(exc))
    return row


def write_docs(rows: list[dict], seconds: float, out: Path) -> None:
    import transformers

    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    loads = [r for r in rows if r["status"] == "loads"]
    built = [r for r in rows if r["status"] != "does not build"]
    same = [r for r in loads if r.get("write_back") == "same files"]
    lines = [
        "# Published weights (generated by `scripts/published_sweep.py`)",
        "",
        f"Every causal-LM model type of transformers {transformers.__version__} whose tiny model "
        "(`scripts/tiny.py`) has checkpoint conversion rules: written by `save_pretrained` in the published "
        "layout, loaded by shardlm's loader in one process through transformers' rules and compared bit for bit "
        "with the saved model, then written back tensor by tensor as `shardlm consolidate` does and compared "
        f"with the files `save_pretrained` wrote. Took {seconds / 60:.1f} min.",
        "",
        f"{len(rows)} types have rules ({len(built)} build at tiny sizes); {len(loads)} load exactly; "
        f"{len(same)} of them are written back as the "
        "same files. **read**: in-memory tensors read by a renamed key (`rename`), as boxes of their source "
        "tensors, each rank only its rows (`boxes`), or from source tensors read whole (`whole`).",
        "",
        "| model type | rules | operations | status | read | written back |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        read = ", ".join(f"{k} {v}" for k, v in sorted(r.get("read", {}).items()))
        status = r["status"] + (f": `{r['detail']}`" if r.get("detail") else "")
        lines.append(
            f"| {r['type']} | {', '.join(r.get('rules', []))} | {', '.join(r.get('ops', []))} | {status} | {read} "
            f"| {r.get('write_back', '')} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import logging

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    types = args.types.split(",") if args.types else list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    start, rows = time.time(), []
    with tempfile.TemporaryDirectory() as root:
        for model_type in types:
            row = sweep(model_type, root)
            if row is not None:
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = args.out or ("" if args.types else str(REPO / "docs" / "published_weights"))
    if out:
        write_docs(rows, time.time() - start, Path(out))


if __name__ == "__main__":
    main()
