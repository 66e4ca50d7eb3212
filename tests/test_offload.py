"""FSDP CPU offload (``parallel.fsdp_offload: cpu``, FSDP2's ``CPUOffloadPolicy``).

Parity: fsdp=2 with offload trains step for step like one plain transformers + torch process
(``helpers.plain_reference``), with every FSDP parameter offloaded. On this CPU-only machine the
shards are in host memory anyway, so this tests FSDP2's offload code path and its numbers, not a
memory drop; the drop on a GPU is ``shardlm estimate``'s (checked here by its formula: the model
state leaves the device total and is reported as host memory). Refusals: one line, before spawning.
"""

import pytest
from helpers import assert_parity, plain_reference, run_ranks, token_dataset, train_config, write_model_dir

from shardlm.config import load_config
from shardlm.errors import ConfigError


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("offload") / "llama"), "llama")


def _offloaded_run(path: str) -> dict:
    """Rank body (world 2): fsdp=2 with CPU offload; which FSDP parameters offload, (loss, grad_norm) per step."""
    from torch.distributed.fsdp import FSDPModule

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    cfg = train_config(path, {"fsdp": 2, "fsdp_offload": "cpu"}, 1, 2)
    mesh = build_mesh(cfg.parallel)
    model = parallelize(path, mesh, seed=cfg.train.seed)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.module.modules() if isinstance(m, FSDPModule)]
    flags = [p.offload_to_cpu for g in groups if g is not None for p in g.fsdp_params]
    history = Trainer(model, cfg, token_dataset(), mesh).train()
    return {"offloaded": flags, "steps": [(h["loss"], h["grad_norm"]) for h in history]}


@pytest.mark.ranks
def test_offload_matches_one_process(model_path):
    got = run_ranks(_offloaded_run, 2, model_path)
    assert got["offloaded"] and all(got["offloaded"]), got["offloaded"]
    assert_parity(got["steps"], plain_reference(model_path, 4), label="fsdp2 + cpu offload")


PP_RUNS = {"pp2_fsdp2": {"pp": 2}, "zbv_fsdp2": {"pp": 2, "pp_schedule": "ZBVZeroBubble"}}


def _offloaded_pp_runs(path: str) -> list[dict]:
    """Rank body (world 4): each of ``PP_RUNS`` at fsdp=2 with CPU offload in turn; whether every FSDP parameter
    of this rank's stages offloads, and (loss, grad_norm) per step."""
    from torch.distributed.fsdp import FSDPModule

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    out = []
    for layout in PP_RUNS.values():
        cfg = train_config(path, {**layout, "fsdp": 2, "fsdp_offload": "cpu"}, 1, 2)
        mesh = build_mesh(cfg.parallel)
        model = parallelize(path, mesh, seed=cfg.train.seed)
        fsdp = [m._get_fsdp_state()._fsdp_param_group for m in model.module.modules() if isinstance(m, FSDPModule)]
        flags = [p.offload_to_cpu for g in fsdp if g is not None for p in g.fsdp_params]
        history = Trainer(model, cfg, token_dataset(), mesh).train()
        out.append({"offloaded": bool(flags) and all(flags), "steps": [(h["loss"], h["grad_norm"]) for h in history]})
    return out


@pytest.mark.ranks
def test_offload_on_stages_matches_one_process(pp_llama):
    """pp=2 x fsdp=2 with CPU offload (4 ranks) under 1F1B and ZBVZeroBubble (two stages a rank, the blocks kept
    unsharded for the weight pass): every FSDP parameter of every rank's stages offloaded, one process's loss
    and grad_norm at every step."""
    path, ref = pp_llama
    for run, got in zip(PP_RUNS, run_ranks(_offloaded_pp_runs, 4, path), strict=True):
        assert got["offloaded"], run
        assert_parity(got["steps"], ref, label=f"{run} + cpu offload")
        loss = max(abs(a - b) for (a, _), (b, _) in zip(got["steps"], ref))
        norm = max(abs(a - b) / b for (_, a), (_, b) in zip(got["steps"], ref))
        print(f"{run} + cpu offload: loss {loss:.1e}, grad_norm {norm:.1e} relative")


def test_estimate_moves_each_stage_state_to_the_host(model_path):
    """Under pp=2 x fsdp=2 each stage's model state leaves the device total and is reported as host memory."""
    from shardlm.estimate.memory import estimate

    on_device = estimate(model_path, fsdp=2, pp=2)
    offloaded = estimate(model_path, fsdp=2, pp=2, fsdp_offload=True)
    for kept, moved in zip(on_device.stages, offloaded.stages, strict=True):
        assert kept["host"] == 0 and moved["host"] > 0
        assert moved["activations"] == kept["activations"]
        assert kept["total"] - moved["total"] >= moved["state"] > 0, (kept, moved)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.fsdp_offload=gpu"], "parallel.fsdp_offload must be one of none, cpu, got 'gpu'"),
        (["parallel.fsdp_offload=cpu", "parallel.tp=2"], "this layout has no FSDP (fsdp=1, dp_replicate=1)"),
        (["parallel.fsdp_offload=cpu", "parallel.fsdp=2", "parallel.ep=2"], "with parallel.ep > 1 is not supported"),
    ],
)
def test_offload_refusals_are_one_line(model_path, tmp_path, overrides, message):
    data = tmp_path / "d.txt"
    data.write_text("hello\n")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")) as info:
        load_config(raw={"model": model_path, "data": {"path": str(data)}}, overrides=overrides)
    assert "\n" not in str(info.value)


def test_estimate_moves_the_model_state_to_the_host(model_path):
    from shardlm.estimate.memory import estimate
    from shardlm.estimate.rows import STEP_ROWS

    on_device = estimate(model_path, fsdp=2)
    offloaded = estimate(model_path, fsdp=2, fsdp_offload=True)
    assert on_device.bytes == {**offloaded.bytes, "total": on_device.bytes["total"]}  # same rows, another total
    state = offloaded.state_bytes
    assert offloaded.host_bytes == state + offloaded.bytes["optimizer_temporaries"] and on_device.host_bytes == 0
    assert offloaded.bytes["total"] == sum(offloaded.bytes[k] for k in STEP_ROWS)
    assert on_device.bytes["total"] - offloaded.bytes["total"] >= state
    with pytest.raises(ConfigError, match="--fsdp-offload offloads FSDP's shards"):
        estimate(model_path, tp=2, fsdp_offload=True)
