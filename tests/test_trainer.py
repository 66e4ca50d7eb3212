"""Trainer features, each against a reference computed another way.

* bf16: the fp32 run of the same layout (loss within 5% per step over 10 steps), fp32 master
  weights and optimizer state read back from the model and optimizer, bf16 logits.
* activation checkpointing: the same run without it (loss and grad_norm within 1e-6 relative),
  and a forward hook counting the recompute.
* SGD with momentum: a plain transformers + torch.optim.SGD loop.
* eval: F.cross_entropy of the plain transformers model on the same samples; tp=2 and fsdp=2
  against one process after training; training losses unchanged by evaluating mid-run.
* logging: metrics.jsonl against the returned history, TensorBoard event files read back with
  tensorboard's reader, the PNG's plotted points, non-terminal output without ``\\r``.
* the TP batch check: ranks given different data fail at step 1 naming the ranks.

One spawn of two processes holds every tp=2 and fsdp=2 check; the rest runs in this process.
"""

import contextlib
import io
import json
import math
import os
import resource

import pytest
import torch
import torch.nn.functional as F
from helpers import plain_reference, run_fresh_ranks, token_dataset, train_config, write_model_dir

from shardlm import ConfigError, Trainer, build_mesh, init_distributed, load_config, parallelize
from shardlm.train.metrics import Progress, mfu, peak_tflops
from shardlm.train.trainer import mixed_precision_policy

EVAL_N = 13  # eval samples: not a multiple of per_device * dp, so the last batch is ragged


def eval_data():
    return token_dataset(n=EVAL_N, seed=7)


def trainer_for(path, layout, per_device, accum, steps, dataset=None, eval_dataset=None, eval_cfg=None, **train):
    init_distributed()
    cfg = train_config(path, layout, per_device, accum, steps, **train)
    for key, value in (eval_cfg or {}).items():
        setattr(cfg.eval, key, value)
    mesh = build_mesh(cfg.parallel)
    model = parallelize(path, mesh, seed=cfg.train.seed, mp_policy=mixed_precision_policy(cfg.train))
    return Trainer(model, cfg, dataset if dataset is not None else token_dataset(), mesh, eval_dataset=eval_dataset)


def pairs(history):
    return [(h["loss"], h["grad_norm"]) for h in history]


def precision_run(path, layout, per_device, accum, out):
    """bf16 vs fp32 over 10 steps; dtypes of logits, master weights and optimizer state."""
    fp32 = trainer_for(path, layout, per_device, accum, 10, output_dir=f"{out}/fp32").train()
    bf = trainer_for(path, layout, per_device, accum, 10, output_dir=f"{out}/bf16", bf16=True)
    bf16 = bf.train()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in bf.module.parameters()]
    state = [v for s in bf.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    with torch.no_grad():
        logits = bf.forward(bf.dataset.input_ids[:1].to(bf.mesh.device))
    return {
        "fp32": [h["loss"] for h in fp32],
        "bf16": [h["loss"] for h in bf16],
        "autocast": bf.autocast,
        "logits": str(logits.dtype),
        "params": sorted({str(p.dtype) for p in local}),
        "state": sorted({str(v.dtype) for v in state}),
        "n_state": len(state),
    }


def checkpointing_run(path, layout, per_device, accum, out):
    """3 steps with and without activation checkpointing; forwards of one MLP counted."""
    plain = pairs(trainer_for(path, layout, per_device, accum, 3, output_dir=f"{out}/plain").train())
    ac = trainer_for(path, layout, per_device, accum, 3, output_dir=f"{out}/ac", gradient_checkpointing=True)
    calls = []
    # a pre-hook: the recompute stops (torch's early stop) inside the MLP, once its last input is saved
    ac.module.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    return {"plain": plain, "ac": pairs(ac.train()), "mlp_forwards": len(calls)}


def eval_run(path, layout, per_device, accum, out):
    """evaluate() before training (and with max_batches), then 4 steps with eval every 2."""
    tr = trainer_for(
        path, layout, per_device, accum, 4, eval_dataset=eval_data(), eval_cfg={"steps": 2}, output_dir=f"{out}/eval"
    )
    first = tr.evaluate()
    tr.config.eval.max_batches = 2
    limited = tr.evaluate()
    tr.config.eval.max_batches = None
    params = sorted({(type(p).__name__, str(p.dtype)) for p in tr.module.parameters()})
    history = tr.train()
    return {
        "first": first,
        "limited": limited,
        "train": pairs(history),
        "evals": tr.eval_history,
        "training_after_eval": tr.module.training,
        "params_after_eval": params,
    }


def tp2_body(path, out):
    import torch.distributed as dist

    from shardlm.train.tp_checks import check_tp_batches

    result = {
        "precision": precision_run(path, {"tp": 2}, 4, 1, out),
        "checkpointing": checkpointing_run(path, {"tp": 2}, 4, 1, out),
        "eval": eval_run(path, {"tp": 2}, 4, 1, out),
    }
    sgd = trainer_for(path, {"tp": 2}, 4, 1, 3, output_dir=f"{out}/sgd", optim="sgd", sgd_momentum=0.9)
    result["sgd"] = pairs(sgd.train())
    result["sgd_defaults"] = {k: sgd.optimizer.defaults[k] for k in ("momentum", "foreach")}
    rank = dist.get_rank()
    mismatched = trainer_for(path, {"tp": 2}, 4, 1, 2, dataset=token_dataset(seed=1 + rank), output_dir=f"{out}/bad")
    try:
        mismatched.train()
        result["mismatch"] = None
    except RuntimeError as exc:
        result["mismatch"] = str(exc)
    # the same check after the first step: a batch that differs on one rank only
    batch = mismatched.dataset.input_ids[:2]
    from shardlm.data.dataset import Batch

    labels = mismatched.dataset.labels[:2].clone()
    labels[0, 0] = rank
    try:
        check_tp_batches([Batch(batch, labels)], mismatched.mesh.tp.get_group(), 6)
        result["mismatch_later"] = None
    except RuntimeError as exc:
        result["mismatch_later"] = str(exc)
    if rank == 1:  # rank 1's lifetime peak raised 512 MiB above itself: the peak rank 0 logs must be rank 1's
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        torch.ones(int(peak_mib + 512) * 2**18).sum()  # fp32: 2**18 elements per MiB
    good = trainer_for(path, {"tp": 2}, 4, 1, 2, output_dir=f"{out}/mem")
    record = good.train()[-1]
    peaks = [torch.zeros((), dtype=torch.float64) for _ in range(2)]
    dist.all_gather(peaks, torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, dtype=torch.float64))
    result["memory"] = (record["peak_memory_mb"], *(float(p) for p in peaks))
    return result


def fsdp2_body(path, out):
    return {
        "precision": precision_run(path, {"fsdp": 2}, 2, 1, out),
        "checkpointing": checkpointing_run(path, {"fsdp": 2}, 2, 1, out),
        "eval": eval_run(path, {"fsdp": 2}, 1, 2, out),
        "no_eval": pairs(trainer_for(path, {"fsdp": 2}, 1, 2, 4, output_dir=f"{out}/noeval").train()),
    }


def two_ranks_body(path, out):
    """Both layouts in one spawn of two processes (a spawn costs ~40 s of start-up here)."""
    return {"tp2": tp2_body(path, f"{out}/tp2"), "fsdp2": fsdp2_body(path, f"{out}/fsdp2")}


# ----------------------------------------------------------------------------- references


def plain_model(path):
    from shardlm.parallel.weights.fill import reference_model

    return reference_model(path, 0)


def plain_eval_loss(path, n=None):
    """Mean token cross-entropy of the untrained plain model over the first n eval samples."""
    ds = eval_data()
    n = n or len(ds)
    with torch.no_grad():
        logits = plain_model(path)(input_ids=ds.input_ids[:n]).logits
    return F.cross_entropy(logits.flatten(0, 1), ds.labels[:n].flatten(), ignore_index=-100).item()


def plain_sgd(path, steps=3, momentum=0.9):
    """Plain transformers + torch.optim.SGD over the same global batches of 4."""
    return plain_reference(
        path, 4, steps, optimizer=lambda groups, t: torch.optim.SGD(groups, lr=t.learning_rate, momentum=momentum)
    )


def close(a, b, rtol):
    return abs(a - b) <= rtol * abs(b)


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("trainer") / "llama"))


@pytest.fixture(scope="module")
def one_process(model_path, tmp_path_factory):
    """One-process eval run, the same as the spawned ones do."""
    return eval_run(model_path, {}, 4, 1, str(tmp_path_factory.mktemp("one")))


@pytest.fixture(scope="module")
def two_ranks(model_path, tmp_path_factory):
    return run_fresh_ranks(two_ranks_body, 2, model_path, str(tmp_path_factory.mktemp("two")))


@pytest.fixture(scope="module")
def tp2(two_ranks):
    return two_ranks["tp2"]


@pytest.fixture(scope="module")
def fsdp2(two_ranks):
    return two_ranks["fsdp2"]


@pytest.mark.ranks
@pytest.mark.parametrize("layout", ["tp2", "fsdp2"])
def test_bf16_tracks_fp32_with_fp32_master_state(layout, request):
    got = request.getfixturevalue(layout)["precision"]
    assert got["autocast"] == (layout == "tp2")  # fsdp casts through its MixedPrecisionPolicy instead
    assert got["logits"] == "torch.bfloat16"
    assert got["params"] == ["torch.float32"] and got["state"] == ["torch.float32"] and got["n_state"] > 0
    assert len(got["bf16"]) == len(got["fp32"]) == 10
    for step, (b, f) in enumerate(zip(got["bf16"], got["fp32"], strict=True), start=1):
        assert close(b, f, 0.05), f"step {step}: bf16 loss {b} vs fp32 {f}"
    assert got["bf16"] != got["fp32"]  # bf16 really computed something else


@pytest.mark.ranks
@pytest.mark.parametrize("layout", ["tp2", "fsdp2"])
def test_activation_checkpointing_changes_nothing(layout, request):
    got = request.getfixturevalue(layout)["checkpointing"]
    assert len(got["ac"]) == 3
    for step, ((loss, norm), (rloss, rnorm)) in enumerate(zip(got["ac"], got["plain"], strict=True), start=1):
        assert close(loss, rloss, 1e-6) and close(norm, rnorm, 1e-6), f"step {step}: {loss, norm} vs {rloss, rnorm}"
    assert got["mlp_forwards"] == 6  # 3 steps x (forward + recompute in the backward)


@pytest.mark.ranks
def test_sgd_momentum_matches_plain_torch(tp2, model_path):
    assert tp2["sgd_defaults"] == {"momentum": 0.9, "foreach": True}
    for step, ((loss, norm), (rloss, rnorm)) in enumerate(zip(tp2["sgd"], plain_sgd(model_path), strict=True), start=1):
        assert close(loss, rloss, 1e-5) and close(norm, rnorm, 1e-4), f"step {step}: {loss, norm} vs {rloss, rnorm}"


@pytest.mark.ranks
@pytest.mark.parametrize("layout", ["tp2", "fsdp2", "one_process"])
def test_eval_loss_is_plain_cross_entropy(layout, request, model_path):
    got = request.getfixturevalue(layout)["eval"] if layout != "one_process" else request.getfixturevalue(layout)
    ref = plain_eval_loss(model_path)
    assert close(got["first"]["eval_loss"], ref, 1e-5), (got["first"], ref)
    assert close(got["first"]["eval_ppl"], math.exp(ref), 1e-5)
    assert got["first"]["eval_tokens"] == int((eval_data().labels != -100).sum())
    dp, per_device = (2, 1) if layout == "fsdp2" else (1, 4)
    assert close(got["limited"]["eval_loss"], plain_eval_loss(model_path, 2 * dp * per_device), 1e-5)
    assert [e["step"] for e in got["evals"]] == [2, 4] and got["training_after_eval"]
    # sharded fp32 parameters again after an eval forward (FSDP leaves its root unsharded after a forward)
    assert got["params_after_eval"] == [("Parameter" if layout == "one_process" else "DTensor", "torch.float32")]


@pytest.mark.ranks
@pytest.mark.parametrize("layout", ["tp2", "fsdp2"])
def test_eval_during_training_matches_one_process(layout, request, one_process):
    got = request.getfixturevalue(layout)
    for mine, ref in zip(got["eval"]["evals"], one_process["evals"], strict=True):
        assert mine["step"] == ref["step"] and close(mine["eval_loss"], ref["eval_loss"], 1e-5), (mine, ref)
    for (loss, _), (rloss, _) in zip(got["eval"]["train"], one_process["train"], strict=True):
        assert close(loss, rloss, 1e-5)
    if layout == "fsdp2":  # evaluating mid-run leaves training exactly as it was
        assert got["eval"]["train"] == got["no_eval"]


@pytest.mark.ranks
def test_tp_ranks_with_different_batches_fail_naming_them(tp2):
    assert "tensor-parallel ranks [0, 1] got different batches at step 1 (ranks [0] vs [1])" in tp2["mismatch"]
    assert "at step 7" in tp2["mismatch_later"]


@pytest.mark.ranks
def test_peak_memory_is_the_max_over_ranks(tp2):
    logged, rank0, rank1 = tp2["memory"]  # rank 0 logs; each rank's own peak RSS after training
    assert rank1 > rank0 + 256 and rank0 + 256 < logged <= rank1


@pytest.mark.ranks
def test_logging_outputs(model_path, tmp_path):
    """One process: metrics.jsonl, TensorBoard, loss.png and plain non-terminal progress lines."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    tr = trainer_for(
        model_path,
        {},
        2,
        2,
        6,
        eval_dataset=eval_data(),
        eval_cfg={"steps": 4},
        output_dir=out,
        logging_steps=2,
        report_to="tensorboard",
    )
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        history = tr.train()
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    assert [r["step"] for r in history] == [2, 4, 6]
    assert {r.pop("run_id") for r in records} == {tr.run_id}  # every record names the run
    assert records == [history[0], history[1], tr.eval_history[0], history[2], tr.eval_history[1]]
    keys = {"step", "loss", "grad_norm", "learning_rate", "tokens_per_second", "step_time_s", "peak_memory_mb"}
    assert all(set(r) == keys and r["peak_memory_mb"] > 0 for r in history)  # no mfu on CPU
    eval_keys = {"step", "eval_loss", "eval_ppl", "eval_tokens"}
    assert [(e["step"], set(e)) for e in tr.eval_history] == [(4, eval_keys), (6, eval_keys)]

    acc = EventAccumulator(os.path.join(out, "tensorboard"))
    acc.Reload()
    assert [s.step for s in acc.Scalars("train/loss")] == [2, 4, 6]
    assert [s.value for s in acc.Scalars("train/loss")] == pytest.approx([r["loss"] for r in history], rel=1e-6)
    eval_losses = [e["eval_loss"] for e in tr.eval_history]
    assert [s.value for s in acc.Scalars("eval/loss")] == pytest.approx(eval_losses, rel=1e-6)

    png = os.path.join(out, "loss.png")
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        assert image.size == (700, 400)
        series = json.loads(image.text["shardlm_series"])
    assert series["loss"] == [[2, 4, 6], [r["loss"] for r in history]]
    assert series["eval_loss"] == [[4, 6], [e["eval_loss"] for e in tr.eval_history]]

    text = stdout.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["2/6", "4/6", "6/6"]
    assert len([line for line in lines if line.startswith("eval")]) == 2


def test_progress_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = Progress(4, 0, stream)
    record = {"step": 1, "loss": 2.5, "grad_norm": 0.5, "learning_rate": 1e-3, "tokens_per_second": 100.0}
    progress.step(record)
    progress.log(record)  # the bar shows it; no extra line
    progress.close()
    assert progress.bar is not None and "\r" in stream.getvalue() and "1/4" in stream.getvalue()
    assert "loss 2.5000" in stream.getvalue() and "step     1/4" not in stream.getvalue()


def test_mfu_and_peak(monkeypatch):
    # 6 N T / peak: 1e9 params at 1e4 tokens/s on 2 devices of 100 TFLOP/s -> 6e13 / 2e14
    assert mfu(10**9, 1e4, 2, 100.0) == pytest.approx(0.3)
    monkeypatch.delenv("SHARDLM_PEAK_TFLOPS", raising=False)
    assert peak_tflops(torch.device("cpu"), True) is None
    monkeypatch.setenv("SHARDLM_PEAK_TFLOPS", "312")
    assert peak_tflops(torch.device("cpu"), True) == 312.0


@pytest.mark.ranks
def test_optimizer_choice(model_path):
    tr = trainer_for(model_path, {}, 4, 1, 2)
    assert isinstance(tr.optimizer, torch.optim.AdamW) and tr.optimizer.defaults["foreach"] is True
    decay = [g["weight_decay"] for g in tr.optimizer.param_groups]
    one_d = [all(p.ndim < 2 for p in g["params"]) for g in tr.optimizer.param_groups]
    assert decay == [0.1, 0.0] and one_d == [False, True]


def test_activation_checkpointing_needs_model_support():
    from shardlm.train.trainer import enable_activation_checkpointing

    with pytest.raises(ConfigError, match="train.gradient_checkpointing: Linear does not support"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.optim=adam", "train.optim must be one of adamw, sgd"),
        ("train.sgd_momentum=-1", "train.sgd_momentum must be >= 0"),
        ("train.report_to=wandb", "train.report_to must be one of none, tensorboard"),
        ("eval.steps=-2", "eval.steps must be >= 0"),
        ("eval.max_batches=0", "eval.max_batches must be >= 1 or null"),
        ("eval.path=/nonexistent/eval.jsonl", "eval.path: '/nonexistent/eval.jsonl' does not exist"),
        ("eval.nope=1", "unknown config key 'eval.nope'"),
    ],
)
def test_config_errors(model_path, tmp_path, override, message):
    data = tmp_path / "d.txt"
    data.write_text("hello\n")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")) as info:
        load_config(raw={"model": model_path, "data": {"path": str(data)}}, overrides=[override])
    assert "\n" not in str(info.value)
