"""Pipeline parallelism with mixture-of-experts stages and expert parallelism inside a stage, and with
several stages a rank at ``pp=4``, each against one process (``helpers.plain_reference``: fp32, 5 steps,
global batch 4, clipping binding; loss 1e-5 and grad_norm 1e-4 relative at every step).

Qwen3-MoE (2 sparse blocks, 4 experts, top-2): at ``pp=2`` (one block a stage, 2 ranks) and at
``pp=2 x fsdp=2 x ep=2`` (4 ranks: each stage's two data-parallel ranks hold 2 of the 4 experts of its
block and exchange tokens by all-to-all within the stage, ``parallel/runtime/ep.py``). Llama with 8
blocks at ``pp=4`` with 2 stages a rank (one block a stage) under ``Interleaved1F1B`` (loops) and
``ZBVZeroBubble`` (a V; the backward split into input and weight gradients), in one 4-rank world.
Phi-MoE, whose router samples its experts in training, at ``pp=2``: the second stage's draws keyed as one
process's (``parallel/runtime/dropout.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import assert_parity, load_checked, plain_reference, run_ranks, shardlm_losses, write_model_dir
from test_pipeline import ROUTER_REFUSAL

from shardlm import ConfigError
from shardlm.config import load_config
from shardlm.parallel.infer.stages import stage_layout
from shardlm.parallel.model.meta import build_meta_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import tiny_config  # noqa: E402

GLOBAL_BATCH = 4
# name -> (layout, per-device batch, accumulation): the global batch is always 4
LAYOUTS = {
    "pp2": ({"pp": 2}, 2, 2),  # 2 micro-batches (pp) of 2 rows under 1F1B
    "pp2_ep2": ({"pp": 2, "fsdp": 2, "ep": 2}, 1, 2),  # each data-parallel rank's 2 rows cut in 2 micro-batches
    "pp4_interleaved": ({"pp": 4, "pp_schedule": "Interleaved1F1B"}, 4, 1),  # 8 stages, 4 micro-batches
    "pp4_zbv": ({"pp": 4, "pp_schedule": "ZBVZeroBubble"}, 4, 1),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """``{name: model dir}``: Qwen3-MoE as ``scripts/tiny.py`` shrinks it (2 blocks, 4 experts, top-2), and
    Phi-MoE, its router sampling in training as published (jitter 0.01)."""
    root, out = tmp_path_factory.mktemp("pp_moe"), {}
    for name in ("qwen3_moe", "phimoe"):
        config = tiny_config(name)
        assert config.num_hidden_layers == 2 and not config.output_router_logits
        config.save_pretrained(root / name)
        out[name] = str(root / name)
    assert tiny_config("qwen3_moe").num_experts == 4 and tiny_config("phimoe").router_jitter_noise > 0
    return out


@pytest.fixture(scope="module")
def qwen3_moe(models) -> tuple[str, list]:
    """Qwen3-MoE with its one-process reference."""
    return models["qwen3_moe"], plain_reference(models["qwen3_moe"], GLOBAL_BATCH)


@pytest.fixture(scope="module")
def phimoe(models) -> tuple[str, list]:
    """Phi-MoE with the one-process reference drawing the keyed values (``plain_reference(dropout=True)``)."""
    return models["phimoe"], plain_reference(models["phimoe"], GLOBAL_BATCH, dropout=True)


def ep_in_stage(path: str, layout: str) -> dict:
    """Rank body: the run's (loss, grad_norm) per step, this rank's pipeline stage, the pipeline stages of
    the ranks of its expert-parallel group, and how many experts it holds of each block on its stage."""
    import torch.distributed as dist
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(path, shape, per_device, accum)
    mesh = build_mesh(cfg.parallel)
    model = parallelize(path, mesh, seed=cfg.train.seed)
    history = Trainer(model, cfg, token_dataset(), mesh).train()
    stage_of = {int(r): s for s, ranks in enumerate(mesh.world.mesh.reshape(shape["pp"], -1)) for r in ranks}
    peers = dist.get_process_group_ranks(mesh.experts["ep"].get_group())
    experts = [p for name, p in model.module.named_parameters() if name.endswith("experts.gate_up_proj")]
    return {
        "steps": [(h["loss"], h["grad_norm"]) for h in history],
        "stage": stage_of[dist.get_rank()],
        "peer_stages": [stage_of[r] for r in peers],
        "experts": [p.to_local().shape[0] for p in experts],
    }


def test_a_later_stage_resumes_the_router_draws(models):
    """Phi-MoE's router draws (``exponential_``, ``rand_like``) are call sites the stage probe counts: the
    second stage's count resumes where one process's forward has it at the second block (uncounted, a model
    without dropout had no sites at all, and every stage drew from torch's generator: pp=2 step-1 grad_norm
    2.27933 against one process's 2.28023)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardlm.parallel.runtime.dropout import DeterministicDropout, DropoutKey

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models["phimoe"])).train()
    at_block = []
    with DeterministicDropout(DropoutKey(0, 0, torch.arange(1))) as mode:
        model.model.layers[1].register_forward_pre_hook(lambda *a: at_block.append(mode.site))
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert at_block[0] > 0
    assert stage_layout(build_meta_model(models["phimoe"]), 2).sites == (0, at_block[0])


@pytest.mark.ranks
def test_moe_at_pp2_matches_one_process(qwen3_moe, phimoe):
    """Qwen3-MoE's and Phi-MoE's sparse blocks on two stages (the router and the experts of each block whole
    on its stage); Phi-MoE's router draws on the second stage keyed as one process's."""
    got = run_ranks(shardlm_losses, 2, [qwen3_moe[0], phimoe[0]], *LAYOUTS["pp2"])
    assert_parity(got[qwen3_moe[0]], qwen3_moe[1], label="qwen3_moe pp2")
    assert_parity(got[phimoe[0]], phimoe[1], label="phimoe pp2")


@pytest.mark.ranks
def test_expert_parallel_inside_a_stage_matches_one_process(qwen3_moe):
    """pp=2 x fsdp=2 x ep=2: the expert-parallel group of every rank lies within its stage (the all-to-alls
    never wait on another stage's ranks), each rank holds 2 of its block's 4 experts, and the run is one
    process's."""
    path, ref = qwen3_moe
    got = run_ranks(ep_in_stage, 4, path, "pp2_ep2")
    assert_parity(got["steps"], ref, label="qwen3_moe pp2 x fsdp2 x ep2")
    assert got["peer_stages"] == [got["stage"]] * 2, got
    assert got["experts"] == [2], got  # rank 0: stage 0, block 0 only


def test_ep_with_pp_passes_the_checks(models, tmp_path):
    """``parallel.ep`` with ``parallel.pp`` is accepted before spawning, with several stages a rank too
    (Interleaved1F1B), and refused in one line under a schedule with a split backward (ZBVZeroBubble); the
    router's load-balancing loss with ``pp`` is refused in one line (its global counts are needed before the
    first micro-batch's backward)."""
    path = models["qwen3_moe"]
    (tmp_path / "d.txt").write_text("a b c\n")
    train = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}
    raw = {"model": path, "data": {"path": str(tmp_path / "d.txt")}, "train": train}
    assert load_checked(raw={**raw, "parallel": LAYOUTS["pp2_ep2"][0]}).parallel.world_size == 4
    interleaved = {**LAYOUTS["pp2_ep2"][0], "pp_schedule": "Interleaved1F1B"}
    assert load_config(raw={**raw, "parallel": interleaved}).parallel.pp_stages_per_rank == 2  # 2 blocks: config only
    virtual = {**LAYOUTS["pp2_ep2"][0], "pp_schedule": "ZBVZeroBubble"}
    with pytest.raises(ConfigError, match=r"parallel.ep=2 with parallel.pp_schedule=ZBVZeroBubble: torch's") as info:
        load_checked(raw={**raw, "parallel": virtual})
    assert "\n" not in str(info.value)
    router = tiny_config("qwen3_moe")
    router.output_router_logits = True
    router.save_pretrained(tmp_path / "router")
    train = {**train, "gradient_accumulation_steps": 1, "per_device_train_batch_size": 2}
    with pytest.raises(ConfigError, match=ROUTER_REFUSAL) as info:
        load_checked(raw={**raw, "model": str(tmp_path / "router"), "train": train, "parallel": {"pp": 2}})
    assert "\n" not in str(info.value)


def jobs_losses(jobs: list[tuple[str, str]]) -> list:
    """Rank body: ``(model path, layout)`` runs one after another in one world; (loss, grad_norm) per step."""
    return [shardlm_losses([path], *LAYOUTS[layout])[path] for path, layout in jobs]


@pytest.mark.ranks
def test_virtual_stages_at_pp4_match_one_process(tmp_path_factory):
    """Llama with 8 blocks at pp=4, two one-block stages a rank: Interleaved1F1B (rank r holds stages r and
    r + 4) and ZBVZeroBubble (rank r holds r and 7 - r), 4 micro-batches each; pp=4 under 1F1B is
    test_pipeline's ``pp4``."""
    path = write_model_dir(str(tmp_path_factory.mktemp("pp4v") / "llama"), "llama", num_hidden_layers=8)
    ref = plain_reference(path, GLOBAL_BATCH)
    runs = ["pp4_interleaved", "pp4_zbv"]
    for layout, losses in zip(runs, run_ranks(jobs_losses, 4, [(path, layout) for layout in runs])):
        assert_parity(losses, ref, label=f"llama {layout}")
        loss = max(abs(a - b) / b for (a, _), (b, _) in zip(losses, ref))
        norm = max(abs(a - b) / b for (_, a), (_, b) in zip(losses, ref))
        print(f"llama {layout}: loss {loss:.1e}, grad_norm {norm:.1e} relative, {len(ref)} steps")


RESUME_LAYOUTS = {"pp2_ep2": LAYOUTS["pp2_ep2"], "fsdp2": ({"fsdp": 2}, 1, 2)}


def moe_train_and_save(path: str, layout: str, output_dir: str, resume: str | bool = False) -> list[float]:
    """Rank body: 10 steps of ``RESUME_LAYOUTS[layout]`` saving at step 5 (``resume``: from that checkpoint);
    the losses."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    shape, per_device, accum = RESUME_LAYOUTS[layout]
    cfg = train_config(path, shape, per_device, accum, 10, output_dir=output_dir, save_steps=5, resume=resume)
    mesh = build_mesh(cfg.parallel)
    return [h["loss"] for h in Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh).train()]


@pytest.mark.ranks
def test_pp_ep_checkpoint_resumes_at_fsdp2(qwen3_moe, tmp_path):
    """Each stage of pp=2 x fsdp=2 x ep=2 saves its part of one DCP checkpoint (its experts as the ep ranks
    hold them) under the whole model's names: its step 5 resumed at fsdp=2 gives steps 6-10 of the
    uninterrupted fsdp=2 run (1e-5), and the step-5 losses of both runs agree (the same training)."""
    path, _ = qwen3_moe
    piped = run_ranks(moe_train_and_save, 4, path, "pp2_ep2", str(tmp_path / "pp"))
    full = run_ranks(moe_train_and_save, 2, path, "fsdp2", str(tmp_path / "fsdp"))
    resumed = run_ranks(
        moe_train_and_save, 2, path, "fsdp2", str(tmp_path / "resumed"), str(tmp_path / "pp/checkpoints/step-5")
    )
    assert len(resumed) == 5, resumed
    for step, (a, b) in enumerate(zip(piped[:5], full[:5]), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: pp2 x ep2 {a} vs fsdp2 {b}"
    for step, (a, b) in enumerate(zip(resumed, full[5:]), start=6):
        assert abs(a - b) <= 1e-5 * abs(b), f"fsdp2 from pp2 x ep2 step {step}: {a} vs {b}"
