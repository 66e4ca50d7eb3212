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
from helpers import STEPS, run_ranks, token_dataset, train, train_config, train_jobs, write_model_dir

from shardlm import ConfigError, Trainer, build_mesh, parallelize
from shardlm.checkpoint import io as ckpt_io
from shardlm.checkpoint import layout as ckpt_layout
from shardlm.checkpoint import manager as ckpt_manager

pytestmark = pytest.mark.ranks  # every test here starts processes or a process group


def crash_run(model_path: str, output_dir: str) -> None:
    """Subprocess body: train, and die (os._exit) inside the save of step 10 after every shard
    was written but before the marker: what a kill mid-save leaves behind."""
    finalize = ckpt_manager.finalize

    def die_at_step_10(tmp, final, marker):
        if final.endswith("step-10"):
            os._exit(3)
        finalize(tmp, final, marker)

    ckpt_manager.finalize = die_at_step_10
    train(model_path, "one", output_dir)


def metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def assert_close(got: list[float], ref: list[float], rtol: float) -> None:
    assert len(got) == len(ref), (got, ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= rtol * abs(b), f"step {i + 6}: {a} vs uninterrupted {b}"


def test_tp2_resume_is_exact_and_appends(tp2_runs):
    assert len(tp2_runs["full"]) == STEPS
    assert_close(tp2_runs["same"], tp2_runs["full"][5:], 1e-6)
    marker = ckpt_layout.read_marker(tp2_runs["step5"])
    assert marker["step"] == 5 and marker["samples_seen"] == 20 and marker["layout"]["tp"] == 2
    assert marker["config"]["train"]["save_steps"] == 5
    assert sorted(os.listdir(os.path.join(tp2_runs["root"], "a", "checkpoints"))) == ["step-10", "step-5"]
    assert [m["step"] for m in metrics(str(tp2_runs["root"] / "b"))] == list(range(6, 11))


def test_resume_on_other_layouts(tp2_runs, one_process):
    assert_close(tp2_runs["fsdp"], tp2_runs["full"][5:], 1e-5)
    assert_close(tp2_runs["tied_fsdp"], tp2_runs["tied_full"][5:], 1e-5)
    one = train(tp2_runs["model"], "one", str(tp2_runs["root"] / "d"), resume=tp2_runs["step5"])
    assert_close(one, tp2_runs["full"][5:], 1e-5)
    root = tp2_runs["root"]
    step5 = {run: str(root / run / "checkpoints" / "step-5") for run in ("q", "z")}
    four, qwen, zaya = run_ranks(
        train_jobs,
        4,
        [
            (tp2_runs["model"], "tp2_fsdp2", str(root / "e"), {"resume": tp2_runs["step5"]}),
            (tp2_runs["qwen35"], "tp2_fsdp2", str(root / "qe"), {"resume": step5["q"]}),
            (tp2_runs["zaya"], "tp2_fsdp2", str(root / "ze"), {"resume": step5["z"]}),
        ],
    )
    assert_close(four, tp2_runs["full"][5:], 1e-5)
    # Qwen3.5: PartsShard under FSDP's chunks; Zaya: RowsShard under them (rank 0's v_proj_current chunked over
    # FSDP, its v_proj_delayed empty); each loaded from tp=2 and saved again at tp=2 x fsdp=2 (step 10): its
    # consolidation equals the tp=2 run's
    assert_close(qwen, tp2_runs["qwen35_full"][5:], 1e-5)
    assert_close(zaya, tp2_runs["zaya_full"][5:], 1e-5)
    from safetensors.torch import load_file

    from shardlm.checkpoint import export

    for runs in (("q", "qe"), ("z", "ze")):
        weights = []
        for run in runs:
            export.consolidate(str(root / run), str(root / f"hf-{run}-10"))
            weights.append(load_file(str(root / f"hf-{run}-10" / "model.safetensors")))
        assert weights[0].keys() == weights[1].keys()
        for key, tensor in weights[0].items():
            torch.testing.assert_close(weights[1][key], tensor, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("model", ["kimi", "qwen35", "zaya"])
def test_hybrid_tp2_checkpoint_resumes_in_one_process(tp2_runs, one_process, model):
    """A tp=2 save continues in one process. Kimi-Linear: delta attention split by heads (its
    ``A_log`` [1, 1, heads, 1] sharded on dim 2, the gates' latents whole), MLA and experts.
    Qwen3.5 text: ``in_proj_qkv`` (q|k|v of unequal widths) and the conv over it hold each rank's
    chunk of every part (``PartsShard``), parameters and AdamW states saved at their HF rows (a
    state saved at the wrong rows would change every step after the resume). Zaya: its value projections
    stored by the rows each rank computes (``RowsShard``: rank 0 all of ``v_proj_current``, none of
    ``v_proj_delayed``), read back whole."""
    run = {"kimi": "k", "qwen35": "q", "zaya": "z"}[model]
    step5 = str(tp2_runs["root"] / run / "checkpoints" / "step-5")
    one = train(tp2_runs[model], "one", str(tp2_runs["root"] / f"{run}1"), resume=step5)
    assert_close(one, tp2_runs[f"{model}_full"][5:], 1e-5)


def test_state_dicts_get_their_parameters_placements_back(one_process):
    """A state dict value a DTensor op handed back with its equal-comparing twin (``shards.PartsShard``:
    DTensor's sharding propagation cache) gets its parameter's placement again, by key, model and
    flattened optimizer state alike, in both directions: a packed parameter's plain ``Shard`` gets its
    parts back, a plain parameter's ``PartsShard`` (another tensor's parts) becomes ``Shard`` again,
    so DCP saves each at its own rows; other values are left alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from shardlm.distributed.shards import PartsShard, RowsShard, is_packed, keep_placements_in

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    rows = RowsShard(0, (((0, 8),),))  # Zaya's value projections: the rows each rank computes
    placements = {
        "m.in_proj.weight": PartsShard(0, (2, 2, 4)),
        "m.gate.weight": Shard(0),
        "m.norm": Replicate(),
        "m.v.weight": rows,
    }
    given = {
        "state.m.v.weight.exp_avg": PartsShard(0, (4, 4)),
        "m.in_proj.weight": Shard(0),
        "state.m.in_proj.weight.exp_avg": Shard(0),
        "state.m.out_proj.weight.exp_avg": Shard(0),
        "m.gate.weight": PartsShard(0, (4, 4)),
        "state.m.gate.weight.exp_avg_sq": PartsShard(0, (2, 6)),
        "m.norm": Replicate(),
    }
    state = {k: DTensor.from_local(torch.zeros(8, 3), mesh, [p], run_check=False) for k, p in given.items()}
    keep_placements_in(state, placements)
    assert [is_packed(v) for v in state.values()] == [True, True, True, False, False, False, False]
    assert state["state.m.v.weight.exp_avg"].placements[0].rows == rows.rows
    assert state["state.m.in_proj.weight.exp_avg"].placements[0].parts == (2, 2, 4)
    assert [type(state[k].placements[0]) for k in ("m.gate.weight", "state.m.gate.weight.exp_avg_sq")] == [Shard] * 2


def test_load_restores_state_and_refuses_a_different_run(tp2_runs, one_process):
    from safetensors.torch import load_file

    root, step5 = tp2_runs["root"], tp2_runs["step5"]
    cfg = train_config(tp2_runs["model"], {}, 2, 2, STEPS, output_dir=str(root / "x"))
    mesh = build_mesh(cfg.parallel)
    trainer = Trainer(parallelize(tp2_runs["model"], mesh), cfg, token_dataset(), mesh)
    trainer.load_checkpoint(step5)
    assert trainer.step == 5 and trainer.scheduler.last_epoch == 5
    assert trainer.scheduler.get_last_lr() == ckpt_layout.read_marker(step5)["scheduler"]["_last_lr"]
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
    assert not os.path.exists(os.path.join(out, "checkpoints", names[1], ckpt_layout.MARKER))
    assert os.listdir(os.path.join(out, "checkpoints", names[1]))  # shards were written
    assert ckpt_layout.find_latest(out).endswith("step-5")
    with pytest.raises(ConfigError, match="unfinished save"):
        ckpt_layout.resolve(os.path.join(out, "checkpoints", names[1]))
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
    size = os.path.getsize(shard)
    with pytest.raises(ConfigError, match=rf"__1_0.distcp does not match its manifest \({size} bytes, \d+ were"):
        train(tp2_runs["model"], "one", str(tmp_path / "x"), resume=step)
    with pytest.raises(ConfigError, match=r"shard file '.*__1_0.distcp' is truncated"):  # DCP's own check
        ckpt_io.read_metadata(step)
    os.remove(shard)
    with pytest.raises(ConfigError, match=r"shard file '.*__1_0.distcp' is missing"):
        ckpt_io.read_metadata(step)
    os.remove(os.path.join(step, ckpt_layout.MARKER))
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
        ckpt_io.read_metadata(step)
    module = b"torch.distributed.checkpoint.metadata"  # allowed module that imports os: STACK_GLOBAL 'os.system'
    dotted = b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c\x09os.system\x93\x8c\x04true\x85R."
    assert pickle.loads(dotted) == 0  # plain pickle would run os.system('true')
    with open(os.path.join(step, ".metadata"), "wb") as fh:
        fh.write(dotted)
    with pytest.raises(ConfigError, match="refusing to unpickle torch.distributed.checkpoint.metadata.os.system"):
        ckpt_io.read_metadata(step)


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
