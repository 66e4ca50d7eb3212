"""End to end through the real entry points: a 2-node torchrun job on localhost, and the
seeds' overfit check on a small instruction set.

References: the one-process CLI run of the same config (losses 1e-5 relative), and the
run's own first loss (the overfit check: below 20% of it within 60 steps at tp=2).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import finish_cli, start_cli, write_cli_model

pytestmark = pytest.mark.ranks  # every test here starts processes or a process group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _losses(output_dir: Path) -> list[float]:
    with open(output_dir / "metrics.jsonl") as fh:
        return [r["loss"] for r in map(json.loads, fh) if "loss" in r]


def _instruction_data(path: Path) -> Path:
    """16 prompt/response rows about the corpus' town; padding and prompt masks everywhere."""
    names = ["Mara", "Ben", "Nora", "Tom", "Mrs Hale", "Mr Reed", "the fishers", "the baker"]
    places = ["the lighthouse", "the bakery", "the garden", "the station"]
    with open(path, "w") as fh:
        for i in range(16):
            who, where = names[i % 8], places[i % 4]
            fh.write(
                json.dumps(
                    {
                        "prompt": f"Where does {who} go in the morning?",
                        "response": f"{who} walks to {where} and stays until noon.",
                    }
                )
                + "\n"
            )
    return path


def _config(path: Path, model: Path, data: Path, out: Path, extra: str = "") -> Path:
    path.write_text(
        f"model: {model}\n"
        f"data:\n  path: {data}\n  seq_len: 32\n{extra}"
        f"train:\n  output_dir: {out}\n  max_steps: 4\n  per_device_train_batch_size: 2\n"
        "  learning_rate: 1.0e-2\n  warmup_steps: 1\n  max_grad_norm: 0.5\n"
    )
    return path


def test_two_nodes_on_localhost_match_one_process(tmp_path):
    """torchrun --nnodes 2 --node_rank {0,1} with c10d rendezvous, tp=2 x fsdp=2, against one process."""
    model = write_cli_model(tmp_path / "model")
    corpus = Path(__file__).resolve().parents[1] / "examples" / "data" / "corpus.txt"
    cfg = _config(tmp_path / "cfg.yaml", model, corpus, tmp_path / "multi")
    one = start_cli(cfg, f"train.output_dir={tmp_path / 'one'}", "train.per_device_train_batch_size=4")
    port = _free_port()
    nodes = {}
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "2",
            "--node_rank",
            str(node),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"localhost:{port}",
            "--rdzv_id",
            "shardlm-test",
            "-m",
            "shardlm.cli",
            "train",
            str(cfg),
            "parallel.tp=2",
            "parallel.fsdp=2",
        ]
        nodes[node] = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
    results = finish_cli({"one": one, **nodes}, timeout=400)
    for key, (rc, _, err) in results.items():
        assert rc == 0, (key, err[-2000:])
    multi, single = _losses(tmp_path / "multi"), _losses(tmp_path / "one")
    assert len(multi) == len(single) == 4
    for a, b in zip(multi, single):
        assert abs(a - b) <= 1e-5 * abs(b), (multi, single)


def test_overfit_small_instruction_set_at_tp2(tmp_path):
    """The seeds' end-to-end check: loss below 20% of its start within 60 steps at tp=2."""
    model = write_cli_model(tmp_path / "model")
    data = _instruction_data(tmp_path / "sft.jsonl")
    extra = "  packing: false\n  prompt_field: prompt\n  response_field: response\n"
    cfg = _config(tmp_path / "cfg.yaml", model, data, tmp_path / "out", extra)
    proc = start_cli(
        cfg,
        "parallel.tp=2",
        "train.max_steps=60",
        "train.learning_rate=1.0e-2",
        "train.warmup_steps=5",
        "train.per_device_train_batch_size=8",
    )
    ((rc, _, err),) = finish_cli({"run": proc}, timeout=400).values()
    assert rc == 0, err[-2000:]
    losses = _losses(tmp_path / "out")
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])
