"""Faults, each against an uninterrupted run: a killed rank, SIGTERM, non-finite steps, timeouts.

Real 2-rank runs (tp=2, gloo, localhost) through ``launch.spawn``, the launcher the CLI uses;
faults are injected in the rank bodies below (a patched ``Trainer.outputs``), never in shardlm.
Two spawns: the first checks the collective timeout and then loses rank 1 to SIGKILL mid-step;
the second resumes that run and holds every other check. References: the uninterrupted run's
own losses (same layout: 1e-6 relative, as in test_checkpoint.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from helpers import run_fresh_ranks, token_dataset, train_config, write_model_dir

from shardlm import ConfigError, ParallelConfig, Trainer, build_mesh, init_distributed, load_config, parallelize
from shardlm.distributed.launch import RankFailed, root_failure
from shardlm.train.faults import NonFiniteError

STEPS, SAVE = 6, 2
KILL_AT = 5  # rank 1 dies in the forward of step 5: the last complete checkpoint is step-4
TIMEOUT_S = 3.0


def train(model: str, output_dir: str, **train_kw) -> list[float]:
    return [h["loss"] for h in trainer(model, output_dir, **train_kw).train()]


def trainer(model: str, output_dir: str, **train_kw) -> Trainer:
    cfg = train_config(model, {"tp": 2}, 4, 1, STEPS, output_dir=output_dir, **{"save_steps": SAVE, **train_kw})
    mesh = build_mesh(cfg.parallel)
    return Trainer(parallelize(model, mesh), cfg, token_dataset(), mesh)


def patch_forward(at_steps: set[int], action) -> None:
    """Make ``Trainer.outputs`` (the training step's forward) call ``action(trainer, logits)``
    during the given (1-based) steps; its result replaces the logits."""
    outputs = Trainer.outputs

    def patched(self, input_ids, position_ids=None):
        out = outputs(self, input_ids, position_ids)
        if self.step + 1 in at_steps:
            out.logits = action(self, out.logits)
        return out

    Trainer.outputs = patched


def unpatch(original=Trainer.outputs) -> None:
    Trainer.outputs = original


# ---------------------------------------------------------------- the rank bodies


def presync() -> None:
    """Wait for both ranks on the launcher's store, so the short timeout does not race process startup."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=120))
    store.add("faults_presync", 1)
    while int(store.add("faults_presync", 0)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)


def timeout_check() -> dict:
    """Rank 1 never joins an all-reduce on a group made after init: rank 0 must fail after ~TIMEOUT_S.

    Then both groups get a long timeout back (test only), so a loaded machine cannot time out
    the training runs that follow in this spawn.
    """
    group = dist.new_group([0, 1])
    mesh = build_mesh(ParallelConfig(tp=2))  # its 1-rank dp groups are new groups too
    assert mesh.dp_group is not None
    groups = list(c10d._world.pg_map)
    timeouts = {g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups}
    result = {"timeouts": sorted(timeouts), "groups": len(groups)}
    if dist.get_rank() == 0:
        start = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError
            result["error"] = str(exc)
        result["elapsed"] = time.perf_counter() - start
    else:
        time.sleep(TIMEOUT_S + 0.5)
    dist.barrier()
    c10d._set_pg_timeout(timedelta(minutes=10), dist.group.WORLD)
    c10d.default_pg_timeout = timedelta(minutes=10)
    return result


def sigterm_run(model: str, output_dir: str, target: str, resume: bool) -> dict:
    """SIGTERM during step 3, to rank 1 itself or (from rank 0) to the launcher; then resume."""
    if target == "worker" and dist.get_rank() == 1:
        patch_forward({3}, lambda t, logits: os.kill(os.getpid(), signal.SIGTERM) or logits)
    if target == "launcher" and dist.get_rank() == 0:
        patch_forward({3}, lambda t, logits: os.kill(os.getppid(), signal.SIGTERM) or logits)
    t = trainer(model, output_dir)
    first = [h["loss"] for h in t.train()]
    unpatch()
    return {"first": first, "stopped_at": t.step, "resumed": train(model, output_dir, resume=True) if resume else []}


def nan_logits(t, logits):
    return logits * float("nan")


def weights(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def skip_run(model: str, output_dir: str) -> dict:
    """NaN logits at step 2: its update is skipped, the weights stay as after step 1."""
    patch_forward({2}, nan_logits)
    t = trainer(model, output_dir, save_steps=0)
    records, snapshots = [], []
    for _ in range(3):
        records.append(t.train_step())
        snapshots.append(weights(t.module))
    unpatch()
    same = all(torch.equal(snapshots[0][n], snapshots[1][n]) for n in snapshots[0])
    moved = any(not torch.equal(snapshots[1][n], snapshots[2][n]) for n in snapshots[0])
    grads = [p.grad for p in t.module.parameters()]
    return {"records": records, "unchanged": same, "moved_after": moved, "grads_none": all(g is None for g in grads)}


def abort_run(model: str, output_dir: str) -> str:
    """NaN at steps 2, 3 and 4: training stops at step 4 (train.max_bad_steps=3)."""
    patch_forward({2, 3, 4}, nan_logits)
    try:
        train(model, output_dir, save_steps=0)
    except NonFiniteError as exc:
        return str(exc)
    finally:
        unpatch()
    return "no error"


def rank_body(model: str, root: str) -> None:
    """Every check that needs two ranks, results to ``results.json``; then rank 1 is SIGKILLed mid-step."""
    presync()
    init_distributed(TIMEOUT_S)
    results = {"timeout": timeout_check()}
    jobs = {
        "reference": lambda: train(model, f"{root}/reference", save_steps=0),
        "worker": lambda: sigterm_run(model, f"{root}/worker", "worker", resume=True),
        "launcher": lambda: sigterm_run(model, f"{root}/launcher", "launcher", resume=False),
        "skip": lambda: skip_run(model, f"{root}/skip"),
        "abort": lambda: abort_run(model, f"{root}/abort"),
    }
    for name, job in jobs.items():
        results[name] = job()
    rank = dist.get_rank()
    if rank == 0:
        with open(f"{root}/results.json", "w") as fh:
            json.dump(results, fh)
    with open(f"{root}/pid{rank}", "w") as fh:
        fh.write(str(os.getpid()))
    if rank == 1:
        patch_forward({KILL_AT}, lambda t, logits: os.kill(os.getpid(), signal.SIGKILL))
    train(model, f"{root}/killed")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One spawn of two ranks (rank_body), then the killed run resumed here in one process."""
    root = tmp_path_factory.mktemp("faults")
    model = write_model_dir(str(root / "llama"), "llama")
    start = time.perf_counter()
    with pytest.raises(RankFailed) as info:
        run_fresh_ranks(rank_body, 2, model, str(root))
    elapsed = time.perf_counter() - start
    results = json.loads((root / "results.json").read_text())
    init_distributed()
    try:
        cfg = train_config(model, {}, 4, 1, STEPS, output_dir=str(root / "killed"), save_steps=SAVE, resume=True)
        mesh = build_mesh(cfg.parallel)
        after_kill = [h["loss"] for h in Trainer(parallelize(model, mesh), cfg, token_dataset(), mesh).train()]
    finally:
        dist.destroy_process_group()
    return {**results, "root": root, "error": str(info.value), "elapsed": elapsed, "after_kill": after_kill}


def assert_close(got: list[float], ref: list[float], rtol: float = 1e-6) -> None:
    assert len(got) == len(ref), (got, ref)
    for a, b in zip(got, ref):
        assert abs(a - b) <= rtol * abs(b), (got, ref)


@pytest.mark.ranks
def test_killed_rank_fails_the_job_naming_it(runs):
    assert runs["error"].startswith("rank 1 failed: killed by signal SIGKILL"), runs["error"]
    assert runs["elapsed"] < 120
    pids = [int((runs["root"] / f"pid{r}").read_text()) for r in (0, 1)]
    assert not any(alive(pid) for pid in pids), pids
    steps = sorted(p.name for p in (runs["root"] / "killed" / "checkpoints").iterdir())
    assert steps == ["step-2", "step-4", "step-6"], steps  # step-6 by the resumed run; nothing half-written


@pytest.mark.ranks
def test_resume_after_kill_continues_from_the_last_checkpoint(runs):
    # resumed in one process (tp=2 -> 1): same losses within test_checkpoint.py's cross-layout 1e-5
    assert_close(runs["after_kill"], runs["reference"][KILL_AT - 1 :], rtol=1e-5)


@pytest.mark.ranks
def test_collective_timeout(runs):
    result = runs["timeout"]
    assert result["timeouts"] == [TIMEOUT_S] and result["groups"] >= 4  # default, new_group, DeviceMesh's
    assert "timed out" in result["error"].lower(), result["error"]
    assert TIMEOUT_S * 0.9 <= result["elapsed"] < TIMEOUT_S + 15, result["elapsed"]


@pytest.mark.ranks
@pytest.mark.parametrize("target", ["worker", "launcher"])
def test_sigterm_saves_at_an_agreed_step(runs, target):
    run = runs[target]
    stop = run["stopped_at"]
    assert 3 <= stop < STEPS, run  # the step during which the signal came, or the next one
    assert (runs["root"] / target / "checkpoints" / f"step-{stop}" / "shardlm_checkpoint.json").is_file()
    assert_close(run["first"], runs["reference"][:stop])


@pytest.mark.ranks
def test_sigterm_to_a_worker_stops_at_that_step_and_resumes_exactly(runs):
    assert runs["worker"]["stopped_at"] == 3
    assert_close(runs["worker"]["resumed"], runs["reference"][3:])


@pytest.mark.ranks
def test_nonfinite_step_is_skipped(runs):
    skip = runs["skip"]
    first, bad, after = skip["records"]
    assert bad["skipped"] is True and "skipped" not in first and "skipped" not in after
    assert bad["loss"] != bad["loss"]  # NaN
    assert skip["unchanged"] and skip["moved_after"] and skip["grads_none"]
    assert after["loss"] == after["loss"]


@pytest.mark.ranks
def test_nonfinite_steps_in_a_row_abort(runs):
    assert runs["abort"].startswith("step 4: 3 steps in a row had a non-finite loss"), runs["abort"]
    assert "the weights are those of step 1" in runs["abort"]
    records = [json.loads(line) for line in (runs["root"] / "abort" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r.get("skipped", False) for r in records] == [False, True, True, True]


# ---------------------------------------------------------------- no processes


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.timeout_s=0", "train.timeout_s must be a positive number"),
        ("train.timeout_s=-5", "train.timeout_s must be a positive number"),
        ("train.timeout_s=.inf", "train.timeout_s must be a positive number"),
        ("train.timeout_s=soon", "config key 'train.timeout_s' must be a number"),
        ("train.max_bad_steps=0", "train.max_bad_steps must be >= 1"),
    ],
)
def test_fault_config_keys_are_validated(tmp_path, override, message):
    model = write_model_dir(str(tmp_path / "m"), "llama")
    data = tmp_path / "d.txt"
    data.write_text("hello\n")
    with pytest.raises(ConfigError, match=message):
        load_config(raw={"model": model, "data": {"path": str(data)}}, overrides=[override])


def test_root_failure_prefers_the_killed_rank():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(rank, exitcode):
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="/nonexistent")
        f.timestamp = 1000
        return f

    # rank 0 lost its peer mid-collective and raised in the same second as rank 1 was killed
    assert root_failure({0: failure(0, 1), 1: failure(1, -9)})[0] == 1
    assert root_failure({0: failure(0, 1), 1: failure(1, -15)})[0] == 0  # SIGTERM: the agent's teardown
