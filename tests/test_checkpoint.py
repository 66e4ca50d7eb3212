"""Checkpoints resume exactly, on any layout, and an interrupted save never looks whole.

References: the uninterrupted run's own losses (same layout: 1e-6 relative; another layout:
1e-5, float summation order differs). Global batch 4 on every layout, fp32, clipping, warmup
+ cosine over 10 steps, saves every 5.
"""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks, token_dataset, train_config, write_model_dir

from shardlm import ConfigError, Trainer, build_mesh, init_distributed, parallelize
from shardlm import checkpoint as ckpt

LAYOUTS = {
    "tp2": ({"tp": 2}, 4, 1),
    "fsdp2": ({"fsdp": 2}, 1, 2),
    "tp2_fsdp2": ({"tp": 2, "fsdp": 2}, 2, 1),
    "one": ({}, 2, 2),
}
STEPS = 10


def train(model_path: str, layout: str, output_dir: str, **train_kw) -> list[float]:
    """One shardlm run on this process's world (any rank); the logged losses."""
    init_distributed()
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(model_path, shape, per_device, accum, STEPS, output_dir=output_dir, save_steps=5, **train_kw)
    mesh = build_mesh(cfg.parallel)
    return [h["loss"] for h in Trainer(parallelize(model_path, mesh), cfg, token_dataset(), mesh).train()]


def train_jobs(jobs: list[tuple]) -> list[list[float]]:
    """Rank body: several runs one after another in one spawn (a spawn costs ~20 s here)."""
    return [train(*job[:3], **(job[3] if len(job) > 3 else {})) for job in jobs]


def crash_run(model_path: str, output_dir: str) -> None:
    """Subprocess body: train, and die (os._exit) inside the save of step 10 after every shard
    was written but before the marker: what a kill mid-save leaves behind."""
    finalize = ckpt._finalize

    def die_at_step_10(tmp, final, marker):
        if final.endswith("step-10"):
            os._exit(3)
        finalize(tmp, final, marker)

    ckpt._finalize = die_at_step_10
    train(model_path, "one", output_dir)


def metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def assert_close(got: list[float], ref: list[float], rtol: float) -> None:
    assert len(got) == len(ref), (got, ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= rtol * abs(b), f"step {i + 6}: {a} vs uninterrupted {b}"


@pytest.fixture
def one_process():
    """In-process one-rank world for cheap single-process runs; torn down afterwards."""
    init_distributed()
    yield
    dist.destroy_process_group()


_SHARED: dict = {}


def shared_runs(tmp_path_factory) -> dict:
    """One 2-rank spawn for this file and test_consolidate.py (a spawn costs ~20 s): uninterrupted
    tp=2 runs of a GQA Llama and a tied-embedding MHA Llama (saves at 5 and 10), then resumes
    from step-5: the GQA one at tp=2 and at fsdp=2, the tied one at fsdp=2."""
    if not _SHARED:
        root = tmp_path_factory.mktemp("ckpt")
        model = write_model_dir(str(root / "llama"), "llama")
        tied = write_model_dir(str(root / "tied"), "llama", num_key_value_heads=4, tie_word_embeddings=True)
        step5, tied5 = (str(root / run / "checkpoints" / "step-5") for run in ("a", "t"))
        jobs = [
            (model, "tp2", str(root / "a")),
            (tied, "tp2", str(root / "t")),
            (model, "tp2", str(root / "b"), {"resume": step5}),
            (model, "fsdp2", str(root / "c"), {"resume": step5}),
            (tied, "fsdp2", str(root / "tc"), {"resume": tied5}),
        ]
        full, tied_full, same, fsdp, tied_fsdp = run_ranks(train_jobs, 2, jobs)
        _SHARED.update(
            root=root,
            model=model,
            tied=tied,
            step5=step5,
            full=full,
            same=same,
            fsdp=fsdp,
            tied_full=tied_full,
            tied_fsdp=tied_fsdp,
        )
    return _SHARED


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    return shared_runs(tmp_path_factory)


def test_tp2_resume_is_exact_and_appends(tp2_runs):
    assert len(tp2_runs["full"]) == STEPS
    assert_close(tp2_runs["same"], tp2_runs["full"][5:], 1e-6)
    marker = ckpt.read_marker(tp2_runs["step5"])
    assert marker["step"] == 5 and marker["samples_seen"] == 20 and marker["layout"]["tp"] == 2
    assert marker["config"]["train"]["save_steps"] == 5
    assert sorted(os.listdir(os.path.join(tp2_runs["root"], "a", "checkpoints"))) == ["step-10", "step-5"]
    assert [m["step"] for m in metrics(str(tp2_runs["root"] / "b"))] == list(range(6, 11))


def test_resume_on_other_layouts(tp2_runs, one_process):
    assert_close(tp2_runs["fsdp"], tp2_runs["full"][5:], 1e-5)
    assert_close(tp2_runs["tied_fsdp"], tp2_runs["tied_full"][5:], 1e-5)
    one = train(tp2_runs["model"], "one", str(tp2_runs["root"] / "d"), resume=tp2_runs["step5"])
    assert_close(one, tp2_runs["full"][5:], 1e-5)
    four = run_ranks(
        train_jobs, 4, [(tp2_runs["model"], "tp2_fsdp2", str(tp2_runs["root"] / "e"), {"resume": tp2_runs["step5"]})]
    )[0]
    assert_close(four, tp2_runs["full"][5:], 1e-5)


def test_load_restores_state_and_refuses_a_different_run(tp2_runs, one_process):
    from safetensors.torch import load_file

    root, step5 = tp2_runs["root"], tp2_runs["step5"]
    cfg = train_config(tp2_runs["model"], {}, 2, 2, STEPS, output_dir=str(root / "x"))
    mesh = build_mesh(cfg.parallel)
    trainer = Trainer(parallelize(tp2_runs["model"], mesh), cfg, token_dataset(), mesh)
    ckpt.load_checkpoint(trainer, step5)
    assert trainer.step == 5 and trainer.scheduler.last_epoch == 5
    assert trainer.scheduler.get_last_lr() == ckpt.read_marker(step5)["scheduler"]["_last_lr"]
    assert torch.equal(torch.get_rng_state(), load_file(os.path.join(step5, "rng", "rank0.safetensors"))["cpu"])
    with pytest.raises(ConfigError, match="global batch 4 but this run has 8"):
        train(tp2_runs["model"], "one", str(root / "x"), resume=step5, gradient_accumulation_steps=4)
    with pytest.raises(ConfigError, match=r"train.seed: 3 differs from the checkpoint's 0"):
        train(tp2_runs["model"], "one", str(root / "x"), resume=step5, seed=3)
    wider = write_model_dir(str(root / "wider"), "llama", intermediate_size=96)
    with pytest.raises(ConfigError, match=r"'model.layers.0.mlp.gate_proj.weight' as \[64, 32\] but 'model' has \[96"):
        train(wider, "one", str(root / "x"), resume=step5)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, one_process):
    model = write_model_dir(str(tmp_path / "llama"), "llama", tie_word_embeddings=True, num_key_value_heads=4)
    out = str(tmp_path / "out")
    code = f"import test_checkpoint as t; t.crash_run({model!r}, {out!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(__file__),
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    names = sorted(os.listdir(os.path.join(out, "checkpoints")), key=len)
    assert names[0] == "step-5" and names[1].startswith("step-10.tmp-") and len(names) == 2
    assert not os.path.exists(os.path.join(out, "checkpoints", names[1], ckpt.MARKER))
    assert os.listdir(os.path.join(out, "checkpoints", names[1]))  # shards were written
    assert ckpt.find_latest(out).endswith("step-5")
    with pytest.raises(ConfigError, match="unfinished save"):
        ckpt.resolve(os.path.join(out, "checkpoints", names[1]))
    uninterrupted = [m["loss"] for m in metrics(out)]  # the crashed run logged all 10 steps
    resumed = train(model, "one", out, resume=True)  # 5 + resume + 5
    assert_close(resumed, uninterrupted[5:], 1e-6)
    assert [m["step"] for m in metrics(out)] == list(range(1, 11)) + list(range(6, 11))  # appended
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step-10", "step-5"]  # leftover removed
    fresh = train(model, "one", str(tmp_path / "fresh"), resume=True)  # nothing to resume: from scratch
    assert_close(fresh, uninterrupted, 1e-6)


def test_save_total_limit(tmp_path, one_process):
    model = write_model_dir(str(tmp_path / "llama"), "llama")
    out = str(tmp_path / "out")
    cfg = train_config(model, {}, 4, 1, 6, output_dir=out, save_steps=2, save_total_limit=2)
    mesh = build_mesh(cfg.parallel)
    Trainer(parallelize(model, mesh), cfg, token_dataset(), mesh).train()
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step-4", "step-6"]


def test_damaged_checkpoint_refused(tp2_runs, one_process, tmp_path):
    import shutil

    step = str(tmp_path / "step-5")
    shutil.copytree(tp2_runs["step5"], step)
    shard = os.path.join(step, "__1_0.distcp")
    with open(shard, "r+b") as fh:
        fh.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(ConfigError, match=r"shard file '.*__1_0.distcp' is truncated"):
        train(tp2_runs["model"], "one", str(tmp_path / "x"), resume=step)
    os.remove(shard)
    with pytest.raises(ConfigError, match=r"shard file '.*__1_0.distcp' is missing"):
        ckpt.read_metadata(step)
    os.remove(os.path.join(step, ckpt.MARKER))
    with pytest.raises(ConfigError, match="the save did not finish"):
        train(tp2_runs["model"], "one", str(tmp_path / "x"), resume=step)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo unpickled > /dev/null",))


def test_metadata_is_not_fully_unpickled(tp2_runs, tmp_path):
    import shutil

    step = str(tmp_path / "step-5")
    shutil.copytree(tp2_runs["step5"], step)
    with open(os.path.join(step, ".metadata"), "wb") as fh:
        pickle.dump(_Boom(), fh)
    with pytest.raises(ConfigError, match="refusing to unpickle posix.system"):
        ckpt.read_metadata(step)
    module = b"torch.distributed.checkpoint.metadata"  # allowed module that imports os: STACK_GLOBAL 'os.system'
    dotted = b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c\x09os.system\x93\x8c\x04true\x85R."
    assert pickle.loads(dotted) == 0  # plain pickle would run os.system('true')
    with open(os.path.join(step, ".metadata"), "wb") as fh:
        fh.write(dotted)
    with pytest.raises(ConfigError, match="refusing to unpickle torch.distributed.checkpoint.metadata.os.system"):
        ckpt.read_metadata(step)


def test_config_checks_before_spawning(tmp_path):
    from shardlm import load_config

    model = write_model_dir(str(tmp_path / "llama"), "llama")
    (tmp_path / "data.txt").write_text("hello world\n")
    raw = {"model": model, "data": {"path": str(tmp_path / "data.txt")}}
    for train_kw, message in [
        ({"resume": str(tmp_path / "nope")}, "train.resume: '.*nope' is not a directory"),
        ({"save_total_limit": 0}, "train.save_total_limit must be >= 1"),
        ({"save_steps": -1}, "train.save_steps must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(raw={**raw, "train": train_kw})
    assert load_config(raw={**raw, "train": {"resume": True, "save_total_limit": 2}}).train.save_total_limit == 2
