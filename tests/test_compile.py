"""``train.compile``: every decoder block's forward through torch.compile, same numbers as one process.

tp=2, fsdp=2, and tp=2 with a LoRA adapter and activation checkpointing (one 2-rank world, one
run after the other) against the plain one-process reference (``helpers.plain_reference``; for
LoRA the same adapter through peft), with the parity tolerances of tests/test_parity.py.
Compiling on this CPU takes a minute or two per layout (inductor's C++ kernels), so this is the one
compile world (with the pipeline's below: pp=2 under 1F1B and Interleaved1F1B, 5 steps), 4 steps each;
the first step runs eagerly (shardlm's dropout masks are drawn then,
``train/compile.py``), so steps 2-4 are the compiled ones.
"""

import pytest
from helpers import (
    assert_parity,
    make_adapter,
    plain_reference,
    run_fresh_ranks,
    token_dataset,
    train_config,
    write_model_dir,
)

from shardlm.config import LoraConfig, load_config
from shardlm.errors import ConfigError

pytestmark = pytest.mark.ranks
STEPS = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("compile") / "llama"), "llama")


def _compiled_runs(path: str, adapter: str) -> dict:
    """Rank body (world 2): tp=2, fsdp=2, then tp=2 + LoRA + activation checkpointing, with
    ``train.compile``; (loss, grad_norm) per step and whether every block's forward was replaced."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.parallel.model.meta import decoder_blocks

    init_distributed()
    out = {}
    runs = (
        ("tp2", {"tp": 2}, 4, 1, {}),
        ("fsdp2", {"fsdp": 2}, 1, 2, {}),
        ("tp2_lora_checkpointing", {"tp": 2}, 4, 1, {"gradient_checkpointing": True}),
    )
    for name, layout, per_device, accum, extra in runs:
        cfg = train_config(path, layout, per_device, accum, STEPS, compile=True, **extra)
        cfg.lora = LoraConfig(adapter=adapter) if "lora" in name else None
        mesh = build_mesh(cfg.parallel)
        model = parallelize(path, mesh, seed=cfg.train.seed, lora_config=cfg.lora)
        trainer = Trainer(model, cfg, token_dataset(), mesh)
        compiled = all("forward" in vars(block) for block in decoder_blocks(trainer.module))
        out[name] = {"compiled": compiled, "steps": [(h["loss"], h["grad_norm"]) for h in trainer.train()]}
    return out


def test_compiled_blocks_match_one_process(model_path, tmp_path):
    from peft import PeftModel

    adapter = make_adapter(model_path, str(tmp_path / "adapter"), ["q_proj", "v_proj"])
    # new processes, as a training run starts: in the pool's long-lived workers, after the models of the
    # tests before it (test_compat's 20-odd types), inductor's partitioner failed on the same graph
    # ("Node tangents_2 was invalid, but is output"; alone, cold cache or warm, it passes)
    got = run_fresh_ranks(_compiled_runs, 2, model_path, adapter)
    ref = plain_reference(model_path, 4, steps=STEPS)
    lora_ref = plain_reference(
        model_path, 4, steps=STEPS, wrap=lambda m: PeftModel.from_pretrained(m, adapter, is_trainable=True)
    )
    for name, run in got.items():
        assert run["compiled"], name
        assert_parity(run["steps"], lora_ref if "lora" in name else ref, label=f"{name} + compile")


PP_SCHEDULES = ["1F1B", "Interleaved1F1B"]  # compiled blocks on stages: each schedule a run in one world


def _compiled_stages(path: str) -> list[dict]:
    """Rank body (world 2): pp=2 with ``train.compile`` under each of ``PP_SCHEDULES``, 5 steps (the one-process
    reference's); whether every block of this rank's stages was compiled, and (loss, grad_norm) per step."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.parallel.model.meta import decoder_blocks

    init_distributed()
    out = []
    for schedule in PP_SCHEDULES:
        cfg = train_config(path, {"pp": 2, "pp_schedule": schedule}, 4, 1, 5, compile=True)
        mesh = build_mesh(cfg.parallel)
        trainer = Trainer(parallelize(path, mesh, seed=cfg.train.seed), cfg, token_dataset(), mesh)
        compiled = all("forward" in vars(block) for block in decoder_blocks(trainer.module))
        out.append({"compiled": compiled, "steps": [(h["loss"], h["grad_norm"]) for h in trainer.train()]})
    return out


def test_compiled_stages_match_one_process(pp_llama):
    """pp=2 (2 ranks, Llama with 4 blocks) with each stage's blocks compiled: one process's loss and grad_norm
    at every step (new processes, as the test above explains)."""
    path, ref = pp_llama
    for schedule, run in zip(PP_SCHEDULES, run_fresh_ranks(_compiled_stages, 2, path), strict=True):
        assert run["compiled"], schedule
        assert_parity(run["steps"], ref, label=f"pp2 {schedule} + compile")


def test_compile_without_a_compiler_is_one_line(model_path, tmp_path, monkeypatch):
    data = tmp_path / "d.txt"
    data.write_text("hello\n")
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ConfigError, match=r"train\.compile=true needs a C\+\+ compiler") as info:
        load_config(raw={"model": model_path, "data": {"path": str(data)}}, overrides=["train.compile=true"])
    assert "\n" not in str(info.value)
