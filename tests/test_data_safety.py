"""Nothing lost, nothing silent: output directories are owned, checkpoints prove their bytes,
faults end with one line.

One real run of the shipped tiny model (``examples/``, tp=2, seq_len 32, 2 steps, a checkpoint
at each) through ``shardlm train`` in a subprocess, with a second training started on the same
output_dir while it lives (refused, and the first run's outputs are those of a lone run: one run
id everywhere, every checkpoint matching its manifest). Its output_dir is then copied for each
other check: a fresh run refused or, with ``train.overwrite_output_dir``, replacing it; a resume
that removes a dead ``.tmp`` save and appends under a new run id (those two run as subprocesses
at one process, together); damaged, truncated, incomplete and foreign checkpoints refused by
``train`` (in this process through ``cli.main``: before any rank, no rank log), ``consolidate``
and the Python load API; a stale lock; a full disk at save and at consolidate (a tmpfs where
this process may mount one, else a patched write); the modes of consolidated files; and ranks
that die with their launcher. Every refusal leaves the directory's bytes as they were (hashed).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import finish_cli, start_cli

from shardlm import ConfigError, Trainer, build_mesh, init_distributed, load_config, parallelize
from shardlm.checkpoint import layout as ckpt_layout
from shardlm.checkpoint.manifest import MANIFEST, verify
from shardlm.checkpoint.output import default_file_mode
from shardlm.checkpoint.ownership import LOCK, OutputDirLock
from shardlm.cli import main
from shardlm.data.dataset import build_dataset
from shardlm.errors import OutOfSpace
from shardlm.train.trainer import load_tokenizer

pytestmark = pytest.mark.ranks  # subprocesses and process groups

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` by relative path: what "unchanged" means here."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def write_config(root: Path) -> Path:
    config = root / "run.yaml"
    config.write_text(
        f"model: {EXAMPLES / 'tiny-llama'}\n"
        f"data: {{path: {EXAMPLES / 'data' / 'corpus.txt'}, seq_len: 32}}\n"
        "parallel: {tp: 2}\n"
        f"train:\n  output_dir: {root / 'run'}\n  max_steps: 2\n  per_device_train_batch_size: 2\n"
        "  learning_rate: 3.0e-3\n  save_steps: 1\n  seed: 0\n"
    )
    return config


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> dict:
    """The run, and a second ``shardlm train`` on its output_dir started once the first holds the lock."""
    root = tmp_path_factory.mktemp("safety")
    config = write_config(root)
    first = start_cli(config)
    lock = root / "run" / LOCK
    deadline = time.monotonic() + 300
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    owner = json.loads(lock.read_text()) if lock.exists() else None
    second = start_cli(config)
    results = finish_cli({"second": second, "first": first}, timeout=600)
    return {"root": root, "config": config, "run": root / "run", "owner": owner, **results}


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_two_runs_on_one_output_dir(finished):
    code, stdout, stderr = finished["first"]
    assert code == 0, stderr[-3000:]
    owner = finished["owner"]
    assert owner is not None and owner["pid"] > 0 and owner["host"] == socket.gethostname()
    code, _, stderr = finished["second"]
    assert code == 2
    line = one_line(stderr)
    assert f"is in use by run {owner['run_id']} (pid {owner['pid']} on host {owner['host']}" in line, line
    run = finished["run"]
    assert not (run / LOCK).exists()  # released at the end
    # the first run's outputs are a lone run's: its id on every record and log line, whole checkpoints
    assert [(m["step"], m["run_id"]) for m in metrics(run)] == [(1, owner["run_id"]), (2, owner["run_id"])]
    for rank in (0, 1):
        lines = (run / "logs" / f"rank{rank}.log").read_text().splitlines()
        assert lines and all(f" run {owner['run_id']} " in line for line in lines)
    assert sorted(os.listdir(run / "checkpoints")) == ["step-1", "step-2"]
    for step in ("step-1", "step-2"):
        step_dir = str(run / "checkpoints" / step)
        manifest = verify(step_dir, ckpt_layout.read_marker(step_dir), ckpt_layout.MARKER_FILES)
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "hf/config.json"} <= set(manifest["files"])
        assert manifest["model"]["type"] == "llama" and manifest["config"]["train"]["save_steps"] == 1


def test_fresh_run_into_a_finished_run_is_refused(finished, capsys):
    before = snapshot(finished["run"])
    assert main(["train", str(finished["config"])]) == 2
    line = one_line(capsys.readouterr().err)
    assert "train.output_dir:" in line and "holds another run's checkpoints (step-1, step-2) and metrics.jsonl" in line
    assert "train.overwrite_output_dir=true" in line and "train.resume=true" in line
    assert snapshot(finished["run"]) == before


def test_fresh_run_into_a_finished_run_is_refused_under_torchrun(finished, capsys, monkeypatch):
    """Under torchrun every rank is its own launcher: rank 0 claims output_dir and every rank gets its
    answer (a one-rank torchrun environment here, in this process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(port))
    before = snapshot(finished["run"])
    try:
        assert main(["train", str(finished["config"]), "parallel.tp=1"]) == 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    line = one_line(capsys.readouterr().err)
    assert "holds another run's checkpoints (step-1, step-2) and metrics.jsonl" in line, line
    assert snapshot(finished["run"]) == before


@pytest.fixture(scope="module")
def reruns(finished) -> dict:
    """Two copies of the finished run trained again at one process, together: one with
    ``train.overwrite_output_dir=true`` (1 step), one resumed to step 3 with a dead ``.tmp`` save planted."""
    root = finished["root"]
    for name in ("overwrite", "resume"):
        shutil.copytree(finished["run"], root / name)
    dead = root / "resume" / "checkpoints" / "step-3.tmp-dead0000"
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"\0" * 1000)
    common = ["parallel.tp=1", "train.save_steps=1"]
    procs = {
        "overwrite": start_cli(
            finished["config"],
            *common,
            f"train.output_dir={root / 'overwrite'}",
            "train.overwrite_output_dir=true",
            "train.max_steps=1",
        ),
        "resume": start_cli(
            finished["config"], *common, f"train.output_dir={root / 'resume'}", "train.resume=true", "train.max_steps=3"
        ),
    }
    return {**finish_cli(procs, timeout=600), "root": root, "dead": dead}


def test_overwrite_output_dir_replaces_the_earlier_run(finished, reruns):
    code, stdout, stderr = reruns["overwrite"]
    assert code == 0, stderr[-3000:]
    out = reruns["root"] / "overwrite"
    assert (
        f"train.overwrite_output_dir: removed the earlier run's checkpoints, logs, loss.png, metrics.jsonl from {out}"
        in stdout
    )
    records = metrics(out)
    assert [m["step"] for m in records] == [1] and records[0]["run_id"] != finished["owner"]["run_id"]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-1"]
    assert not (out / "logs" / "rank1.log").exists()  # the old run's logs went with it


def test_resume_removes_a_dead_save_and_appends_under_its_own_id(finished, reruns):
    code, stdout, stderr = reruns["resume"]
    assert code == 0, stderr[-3000:]
    out = reruns["root"] / "resume"
    assert f"removing {reruns['dead']}, left by an interrupted save" in stdout
    assert sorted(os.listdir(out / "checkpoints")) == ["step-1", "step-2", "step-3"]
    old = finished["owner"]["run_id"]
    ids = [(m["step"], m["run_id"]) for m in metrics(out)]
    assert ids[:2] == [(1, old), (2, old)] and ids[2][0] == 3 and ids[2][1] != old
    log = (out / "logs" / "rank0.log").read_text()
    assert f" run {old} " in log and f" run {ids[2][1]} " in log  # appended, each line naming its run


# ---------------------------------------------------------------- checkpoints that prove their bytes


def other_model(root: Path) -> Path:
    """The tiny Llama with another intermediate_size: a checkpoint of one is foreign to the other."""
    path = root / "other-model"
    if not path.exists():
        shutil.copytree(EXAMPLES / "tiny-llama", path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    return path


def damage(run: Path, kind: str) -> tuple[str, str]:
    """Damage ``run``'s newest checkpoint; (the file named in the error, what the error says)."""
    step = run / "checkpoints" / "step-2"
    shard = step / "__0_0.distcp"
    if kind == "bytes":  # 4 KB of 0xFF, same size
        with open(shard, "r+b") as fh:
            fh.seek(shard.stat().st_size // 2)
            fh.write(b"\xff" * 4096)
        return "__0_0.distcp", "same size, other bytes: sha256 differs"
    if kind == "truncated":
        size = shard.stat().st_size
        with open(shard, "r+b") as fh:
            fh.truncate(size // 2)
        return "__0_0.distcp", f"{size // 2} bytes, {size} were saved"
    if kind == "deleted":
        (step / ".metadata").unlink()
        return ".metadata", "the file is missing"
    raise ValueError(kind)


KINDS = ["bytes", "truncated", "deleted", "foreign"]
EXPECTED_FOREIGN = "'model.layers.0.mlp.down_proj.weight' is [128, 352] there, [128, 256] in"


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_checkpoint_refused_by_train_resume(finished, tmp_path, capsys, kind):
    run = tmp_path / "run"
    shutil.copytree(finished["run"], run)
    shutil.rmtree(run / "logs")
    args = ["train", str(finished["config"]), f"train.output_dir={run}", "train.resume=true", "train.max_steps=3"]
    if kind == "foreign":
        args.append(f"model={other_model(tmp_path)}")
    else:
        name, why = damage(run, kind)
    before = snapshot(run)
    assert main(args) == 2
    line = one_line(capsys.readouterr().err)
    step = run / "checkpoints" / "step-2"
    if kind == "foreign":
        assert line.startswith(f"error: train.resume: checkpoint {step} was saved from another model (")
        assert EXPECTED_FOREIGN in line, line
    else:
        assert line.startswith(f"error: checkpoint {step}: {name} does not match its manifest ({why})"), line
    assert not (run / "logs").exists()  # refused before any rank: a rank would have written logs/rankN.log
    assert snapshot(run) == before


def test_resume_with_another_learning_rate_is_refused(finished, tmp_path, capsys):
    """A resume restores the optimizer and its base learning rate: a configured learning rate that
    differs would be ignored, so it is refused by name, before any rank."""
    run = tmp_path / "run"
    shutil.copytree(finished["run"], run)
    shutil.rmtree(run / "logs")
    saved = json.loads((run / "checkpoints" / "step-2" / "shardlm_checkpoint.json").read_text())["config"]["train"]
    before = snapshot(run)
    args = ["train", str(finished["config"]), f"train.output_dir={run}", "train.resume=true", "train.max_steps=3"]
    assert main([*args, f"train.learning_rate={saved['learning_rate'] * 10}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        f"error: train.learning_rate: {saved['learning_rate'] * 10} differs from the checkpoint's "
    ), line
    assert not (run / "logs").exists() and snapshot(run) == before


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_checkpoint_refused_by_consolidate(finished, tmp_path, capsys, kind):
    run = tmp_path / "run"
    shutil.copytree(finished["run"], run)
    step = run / "checkpoints" / "step-2"
    if kind == "foreign":  # the checkpoint's model description replaced by another model's
        shutil.copy(other_model(tmp_path) / "config.json", step / "hf" / "config.json")
        name, why = "hf/config.json", "bytes, "
    else:
        name, why = damage(run, kind)
    before = snapshot(run)
    assert main(["consolidate", str(run), str(tmp_path / "hf")]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"error: checkpoint {step}: {name} does not match its manifest (") and why in line, line
    assert not [p for p in os.listdir(tmp_path) if p.startswith("hf")]
    assert snapshot(run) == before


@pytest.fixture(scope="module")
def loader(finished):
    """The run's config at one process with its data set: what the Python load API needs."""
    init_distributed()
    try:
        cfg = load_config(str(finished["config"]), ["parallel.tp=1"])
        yield cfg, build_dataset(cfg.data, load_tokenizer(cfg))
    finally:
        dist.destroy_process_group()


def trainer(cfg, dataset, model: str) -> Trainer:
    cfg = dataclasses.replace(cfg, model=model)
    mesh = build_mesh(cfg.parallel)
    return Trainer(parallelize(model, mesh, seed=cfg.train.seed), cfg, dataset, mesh)


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_checkpoint_refused_by_the_load_api(finished, loader, tmp_path, kind):
    cfg, dataset = loader
    run = tmp_path / "run"
    shutil.copytree(finished["run"], run)
    step = run / "checkpoints" / "step-2"
    if kind == "foreign":
        model = str(other_model(tmp_path))
        expected = "'model.layers.0.mlp.gate_proj.weight' as [352, 128] but 'model' has [256, 128]; it was saved from"
    else:
        model, (name, why) = cfg.model, damage(run, kind)
        expected = f"checkpoint {step}: {name} does not match its manifest ({why})"
    t = trainer(cfg, dataset, model)
    with pytest.raises(ConfigError) as info:
        t.load_checkpoint(str(step))
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
    if kind == "bytes":  # the same Trainer loads the intact checkpoint and continues from its step
        assert t.load_checkpoint(str(finished["run"] / "checkpoints" / "step-2"))["step"] == 2 and t.step == 2


def test_checkpoint_without_manifest(finished, tmp_path, capsys):
    """A deleted manifest is refused; a checkpoint saved before manifests (marker format 1, no
    manifest_sha256) cannot be verified and is read, saying so."""
    step = tmp_path / "step-2"
    shutil.copytree(finished["run"] / "checkpoints" / "step-2", step)
    (step / MANIFEST).unlink()
    assert main(["consolidate", str(step), str(tmp_path / "hf")]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"checkpoint {step}: {MANIFEST} does not match its manifest (the file is missing)" in line, line
    marker = json.loads((step / ckpt_layout.MARKER).read_text())
    marker.pop("manifest_sha256")
    (step / ckpt_layout.MARKER).write_text(json.dumps({**marker, "format": 1}))
    assert main(["consolidate", str(step), str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert f"warning: checkpoint {step} has no {MANIFEST} (saved by an older shardlm): bytes not verified" in out
    assert "Save correctness check passed: 21 parameters" in out


def test_consolidated_files_have_the_usual_mode(finished, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["consolidate", str(finished["run"]), str(out)]) == 0
    assert "Save correctness check passed: 21 parameters match" in capsys.readouterr().out
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert set(modes.values()) == {default_file_mode()}, modes  # safetensors alone would give 0o600


# ---------------------------------------------------------------- locks


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lock(folder: Path, pid: int, host: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    owner = {"pid": pid, "host": host, "started": "2026-01-01T00:00:00+0000", "run_id": "old-run", "pid_start": None}
    (folder / LOCK).write_text(json.dumps(owner))


def test_stale_lock_is_reported_and_taken_over(tmp_path, capsys):
    pid = dead_pid()
    write_lock(tmp_path, pid, socket.gethostname())
    with OutputDirLock(str(tmp_path), "new-run"):
        assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "new-run"
    assert not (tmp_path / LOCK).exists()
    out = capsys.readouterr().out
    assert f"taking over the lock of run old-run (pid {pid} on host {socket.gethostname()}" in out
    assert "whose process is gone" in out


def test_live_and_foreign_host_locks_are_refused(tmp_path):
    write_lock(tmp_path, os.getpid(), socket.gethostname())  # this process: alive
    with pytest.raises(ConfigError, match=rf"is in use by run old-run \(pid {os.getpid()} on host"):
        OutputDirLock(str(tmp_path), "new-run").__enter__()
    write_lock(tmp_path, 1, "elsewhere")
    with pytest.raises(ConfigError, match="locked by run old-run .* cannot be checked from .* remove"):
        OutputDirLock(str(tmp_path), "new-run").__enter__()
    assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "old-run"  # never silently broken
    assert sorted(os.listdir(tmp_path)) == [LOCK]


# ---------------------------------------------------------------- full disk, parent death


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs (a process that may mount), or None: the test patches the write instead."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(where)], capture_output=True)
    yield where if mounted.returncode == 0 else None
    if mounted.returncode == 0:
        subprocess.run(["umount", str(where)], check=False)


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_at_save_is_one_line_and_leaves_nothing(finished, loader, small_disk, tmp_path, monkeypatch):
    cfg, dataset = loader
    out = small_disk or tmp_path / "out"
    if small_disk is None:
        monkeypatch.setattr("torch.distributed.checkpoint.filesystem._write_item", no_space)
    (out / "checkpoints" / "step-1.tmp-dead0000").mkdir(parents=True)  # a dead save: removed first
    t = trainer(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(out))), dataset, cfg.model)
    with pytest.raises(OutOfSpace) as info:
        t.save_checkpoint()
    message = str(info.value)
    assert message.startswith(f"no space left on device writing {out / 'checkpoints' / 'step-0'}: it needs about ")
    assert "MB are free there" in message and "\n" not in message
    assert os.listdir(out / "checkpoints") == []  # neither the dead save nor this one's .tmp


def test_full_disk_at_consolidate_is_one_line(finished, small_disk, tmp_path, capsys, monkeypatch):
    out = (small_disk or tmp_path) / "hf"
    if small_disk is None:
        monkeypatch.setattr("shardlm.checkpoint.export.save_file", no_space)
    assert main(["consolidate", str(finished["run"]), str(out)]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"error: no space left on device writing {out}: it needs about 2.0 MB"), line
    assert not out.exists() and not [p for p in os.listdir(out.parent) if p.startswith("hf")]


PARENT = """
import multiprocessing, os, sys, time
from shardlm.distributed.launch import RankEntry
child = multiprocessing.get_context("fork").Process(  # fork: the child need not import shardlm again
    target=RankEntry(exec, sys.argv[1]), args=(f"import time; open({sys.argv[2]!r}, 'w').close(); time.sleep(120)",)
)
child.start()
print(child.pid, flush=True)
time.sleep(120)
"""


def test_ranks_die_with_their_launcher(tmp_path):
    """kill -9 of a launcher: its rank (the entry every spawned rank runs) is gone within seconds."""
    ready = tmp_path / "ready"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path), str(ready)], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:  # the child asked for its parent-death signal
            time.sleep(0.05)
        assert ready.exists()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        start = time.monotonic()
        while time.monotonic() - start < 10:
            try:
                state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                state = "gone"
            if state in ("Z", "X", "gone"):
                break
            time.sleep(0.05)
        assert state in ("Z", "X", "gone"), state
        assert time.monotonic() - start < 5
    finally:
        if parent.poll() is None:
            parent.kill()
