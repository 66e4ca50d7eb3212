"""``scripts/moe_grid.py``'s documents (process-free; the grid itself runs in ``make moe-grid``):
every kind of cell (parity, refusal, failure, resume, reload) lands in the table it belongs to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import moe_grid  # noqa: E402


def test_the_grid_documents_record_every_kind_of_cell(tmp_path):
    counts = [{"all_to_all_single": 6}, {}, {"all_to_all_single": 4, "allreduce_": 3}, {}]
    ok = {
        "layout": "tp=2",
        "ok": True,
        "rel": {"loss": 1.5e-7, "grad_norm": 3e-7},
        "collectives": counts,
        "experts_bytes": (1024, 2048),
        "steps": [(1.0, 2.0)],
    }
    rows = {
        "qwen3_moe": {
            "layouts": {
                "tp2": ok,
                "ep2": {"layout": "ep=2", "refused": "error: parallel.ep=2: no experts"},
                "fsdp2_ep2": {"layout": "fsdp=2 x ep=2", "failed": "RankError: boom"},
                "tp2_ep2": {**ok, "ok": False, "rel": {"loss": 2e-3, "grad_norm": 1e-2}},
            },
            "resumes": {
                "ep2_to_ep1": {"skipped": "no fsdp2_ep2 run to resume"},
                "tp2_to_tp2_ep2": {"rel": 4e-8, "ok": True},
            },
            "reload": None,
        },
        "deepseek_v3": {"error": "one-process reference: ValueError: x", "layouts": {}, "resumes": {}, "reload": None},
    }
    moe_grid.write_docs(rows, 12.0, tmp_path, {"torch": "t"})
    md = (tmp_path / "moe_grid.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| qwen3_moe | ok"))
    assert row.count("|") == len(moe_grid.LAYOUTS) + 5, row
    for text in (
        "ok 1.5e-07 / 3.0e-07",
        "refused: `error: parallel.ep=2: no experts`",
        "**failed**: `RankError: boom`",
        "**over tolerance** 2.0e-03",
        "skipped (no fsdp2_ep2 run",
        "ok 4.0e-08",
        "no fsdp=2 x ep=2 checkpoint",
        "| deepseek_v3 | **failed**: `one-process reference: ValueError: x` |",
        "| qwen3_moe | tp=2 | fwd all_to_all_single 6; bwd all_to_all_single 4, allreduce_ 3 | 1024 of 2048 |",
    ):
        assert text in md, text
    assert json.loads((tmp_path / "moe_grid.json").read_text())["families"]["qwen3_moe"]["layouts"]["tp2"]["ok"]
