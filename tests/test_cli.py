"""The ``shardlm train`` command as users run it: a subprocess, a YAML file and overrides.

Bad input must fail before any rank is spawned: exit code 2, exactly one stderr line
``error: ...``, no traceback, no output directory. A good config must train, write
``metrics.jsonl``, and give the same losses with ``parallel.tp=2`` (two spawned ranks) as with
one process: the parity check through the real command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import finish_cli, start_cli, write_cli_model

pytestmark = pytest.mark.ranks  # every test here starts processes or a process group

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "data" / "corpus.txt"
METRIC_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "learning_rate",
    "tokens_per_second",
    "step_time_s",
    "peak_memory_mb",
    "run_id",
}


def _write_config(path: Path, model: Path, data: Path, output_dir: Path) -> Path:
    path.write_text(
        f"model: {model}\n"
        f"data:\n  path: {data}\n  seq_len: 32\n"
        f"train:\n  output_dir: {output_dir}\n  max_steps: 3\n  per_device_train_batch_size: 2\n"
        "  learning_rate: 1.0e-2\n  warmup_steps: 1\n  max_grad_norm: 0.5\n  weight_decay: 0.1\n"
    )
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cli")
    model = write_cli_model(root / "model")
    data = root / "data.txt"
    data.write_text("the cat sat on the mat\n\nthe dog ran in the park and the sun was warm\n" * 20)
    bad_yaml = root / "bad.yaml"
    bad_yaml.write_text("model: [unclosed\ntrain:\n  max_steps: 3\n")
    return {"root": root, "model": model, "data": data, "bad_yaml": bad_yaml}


# name -> (config "good" | "bad_yaml", extra CLI arguments, substrings the error line must contain)
BAD_INPUT = {
    "unknown_nested_key": ("good", ["train.foo=1"], ["'train.foo'", "max_steps"]),
    "unknown_top_level_key": ("good", ["foo=1"], ["'foo'", "parallel"]),
    "wrong_type": ("good", ["train.max_steps=abc"], ["train.max_steps", "integer", "abc"]),
    "missing_model_dir": ("good", ["model={root}/no-such-model"], ["model", "no-such-model", "config.json"]),
    "missing_data_path": ("good", ["data.path={root}/no-such.txt"], ["data.path", "no-such.txt", "does not exist"]),
    "tp_not_dividing_heads": (
        "good",
        ["parallel.tp=3"],
        ["parallel.tp=3", "num_attention_heads=4", "valid tp", "1, 2"],
    ),
    "nproc_mismatch": ("good", ["parallel.tp=2", "--nproc", "3"], ["--nproc 3", "= 2"]),
    "invalid_yaml": ("bad_yaml", [], ["bad.yaml", "not valid YAML", "line"]),
    "override_without_equals": ("good", ["train.max_steps"], ["train.max_steps", "KEY=VALUE"]),
    "lora_on_vocab_parallel_head": (
        "good",
        ["parallel.tp=2", "lora.target_modules=[lm_head]"],
        ["lora.target_modules", "'lm_head'", "colwise, rowwise, packed_colwise", "remove it"],
    ),
}


# run as users do, one process each (a process start costs seconds on 2 cores); the others go
# through ``cli.main`` in this process: the same code, the same one line and exit code
AS_SUBPROCESS = ("unknown_nested_key", "tp_not_dividing_heads", "nproc_mismatch", "lora_on_vocab_parallel_head")


def _bad_config(workspace, name: str) -> tuple[Path, list[str]]:
    which, args, _ = BAD_INPUT[name]
    root = workspace["root"]
    config = workspace["bad_yaml"] if which == "bad_yaml" else root / f"{name}.yaml"
    if which == "good":
        _write_config(config, workspace["model"], workspace["data"], root / f"out-{name}")
    return config, [a.format(root=root) for a in args]


@pytest.fixture(scope="module")
def bad_runs(workspace) -> dict:
    """The subprocess bad-input commands, started at once and collected."""
    procs = {}
    for name in AS_SUBPROCESS:
        config, args = _bad_config(workspace, name)
        procs[name] = start_cli(config, *args)
    return finish_cli(procs, timeout=300)  # generous: each takes seconds, but the machine may be shared


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_is_one_error_line_and_exit_2(workspace, request, capsys, name):
    if name in AS_SUBPROCESS:
        code, stdout, stderr = request.getfixturevalue("bad_runs")[name]
    else:
        from shardlm.cli import main

        config, args = _bad_config(workspace, name)
        code = main(["train", str(config), *args])
        captured = capsys.readouterr()
        stdout, stderr = captured.out, captured.err
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr + stdout
    for part in BAD_INPUT[name][2]:
        assert part in lines[0], (part, lines[0])
    # refused before any rank started: a rank would have created output_dir/logs/rankN.log
    assert not (workspace["root"] / f"out-{name}").exists()


def _metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_tp2_matches_one_process_through_the_cli(tmp_path):
    model = write_cli_model(tmp_path / "model")
    outs = {tp: tmp_path / f"out-tp{tp}" for tp in (1, 2)}
    # both at once: the tp=1 process and the two tp=2 ranks share the cores
    procs = {
        tp: start_cli(_write_config(tmp_path / f"tp{tp}.yaml", model, CORPUS, out), f"parallel.tp={tp}")
        for tp, out in outs.items()
    }
    metrics = {}
    for tp, (code, _, stderr) in finish_cli(procs, timeout=500).items():
        assert code == 0, stderr[-3000:]
        metrics[tp] = _metrics(outs[tp])
        assert (outs[tp] / "logs" / "rank0.log").exists()
    assert (outs[2] / "logs" / "rank1.log").exists() and not (outs[1] / "logs" / "rank1.log").exists()
    for records in metrics.values():
        assert [r["step"] for r in records] == [1, 2, 3], records
        for r in records:
            assert set(r) == METRIC_KEYS and r["run_id"] == records[0]["run_id"], r
            assert r["tokens_per_second"] > 0 and r["step_time_s"] > 0
    for one, two in zip(metrics[1], metrics[2]):
        assert abs(two["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]), (one, two)
        assert abs(two["grad_norm"] - one["grad_norm"]) <= 1e-4 * abs(one["grad_norm"]), (one, two)
        assert two["learning_rate"] == one["learning_rate"]
    # training moved: the loss of step 3 differs from step 1 (the run is not a no-op)
    assert metrics[1][2]["loss"] != metrics[1][0]["loss"]


# Inputs that used to escape as tracebacks or wrong errors; checked in this process through
# ``cli.main`` (the same code as the subprocess, without paying a process start for each).
IN_PROCESS_BAD = {
    "yaml_list_not_mapping": ("- model\n- data\n", [], "must be a mapping of keys"),
    "yaml_scalar_not_mapping": ("just text\n", [], "must be a mapping of keys"),
    "override_value_not_yaml": (None, ["train.output_dir=[unclosed"], "train.output_dir=[unclosed"),
    "override_into_a_value": (None, ["model.path=x"], "'model' is not a section"),
    "section_not_mapping": (None, ["parallel=4"], "'parallel' must be a mapping"),
    "lora_target_missing": (None, ["lora.target_modules=[nope]"], "lora.target_modules: Target modules {'nope'}"),
    "lora_bad_r": (None, ["lora.r=0"], "lora.r must be >= 1"),
    "lora_adapter_missing": (None, ["lora.adapter=/no/such/adapter"], "lora.adapter: '/no/such/adapter' is not a"),
}


@pytest.mark.parametrize("name", list(IN_PROCESS_BAD))
def test_bad_input_in_process(workspace, capsys, name):
    from shardlm.cli import main

    text, args, expected = IN_PROCESS_BAD[name]
    config = workspace["root"] / f"{name}.yaml"
    if text is None:
        _write_config(config, workspace["model"], workspace["data"], workspace["root"] / f"out-{name}")
    else:
        config.write_text(text)
    assert main(["train", str(config), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_override_fills_an_empty_section_and_leaves_raw_alone(workspace):
    """``data:`` with nothing under it is a null section; ``data.path=...`` must still apply."""
    from shardlm.config import load_config

    raw = {"model": str(workspace["model"]), "data": None, "train": {"max_steps": 3}}
    cfg = load_config(raw=raw, overrides=[f"data.path={workspace['data']}", "train.max_steps=7"])
    assert cfg.data.path == str(workspace["data"]) and cfg.train.max_steps == 7
    assert raw == {"model": str(workspace["model"]), "data": None, "train": {"max_steps": 3}}
