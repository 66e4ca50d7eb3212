"""``train.compile``: every decoder block's forward through torch.compile, same numbers as one process.

tp=2, fsdp=2, and tp=2 with a LoRA adapter and activation checkpointing (one 2-rank world, one
run after the other) against the plain one-process reference (``helpers.plain_reference``; for
LoRA the same adapter through peft), with the parity tolerances of tests/test_parity.py.
Compiling on this CPU takes a minute or two per layout (inductor's C++ kernels), so this is the one
compile world (with pp=2 under Interleaved1F1B, 5 steps, on conftest's 4-block Llama), 4 steps each;
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


# (name, model: "llama" or "pp_llama", layout, per-device batch, accumulation, steps, train keys): one world, new
# processes, as a training run starts (in the pool's long-lived workers, after the models of the tests before it,
# test_compat's 20-odd types, inductor's partitioner failed on the same graph: "Node tangents_2 was invalid, but
# is output"; alone, cold cache or warm, it passes). Stages: Interleaved1F1B, two stages a rank (1F1B's one a
# rank ran as well until its run was dropped for time: the blocks compile alike under every schedule)
RUNS = (
    ("tp2", "llama", {"tp": 2}, 4, 1, STEPS, {}),
    ("fsdp2", "llama", {"fsdp": 2}, 1, 2, STEPS, {}),
    ("tp2_lora_checkpointing", "llama", {"tp": 2}, 4, 1, STEPS, {"gradient_checkpointing": True}),
    ("pp2_interleaved", "pp_llama", {"pp": 2, "pp_schedule": "Interleaved1F1B"}, 4, 1, 5, {}),
)


def _compiled_runs(paths: dict[str, str], adapter: str) -> dict:
    """Rank body (world 2): every run of ``RUNS`` with ``train.compile``, one after the other; (loss, grad_norm)
    per step and whether every block's forward (of this rank's stages) was replaced."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.parallel.model.meta import decoder_blocks

    init_distributed()
    out = {}
    for name, which, layout, per_device, accum, steps, extra in RUNS:
        cfg = train_config(paths[which], layout, per_device, accum, steps, compile=True, **extra)
        cfg.lora = LoraConfig(adapter=adapter) if "lora" in name else None
        mesh = build_mesh(cfg.parallel)
        model = parallelize(paths[which], mesh, seed=cfg.train.seed, lora_config=cfg.lora)
        trainer = Trainer(model, cfg, token_dataset(), mesh)
        compiled = all("forward" in vars(block) for block in decoder_blocks(trainer.module))
        out[name] = {"compiled": compiled, "steps": [(h["loss"], h["grad_norm"]) for h in trainer.train()]}
    return out


@pytest.fixture(scope="module")
def compiled(model_path, pp_llama, tmp_path_factory) -> tuple[dict, str]:
    """Every run of ``RUNS``, and the LoRA adapter they trained."""
    adapter = make_adapter(model_path, str(tmp_path_factory.mktemp("compile") / "adapter"), ["q_proj", "v_proj"])
    paths = {"llama": model_path, "pp_llama": pp_llama[0]}
    return run_fresh_ranks(_compiled_runs, 2, paths, adapter), adapter


def test_compiled_blocks_match_one_process(model_path, compiled):
    from peft import PeftModel

    got, adapter = compiled
    ref = plain_reference(model_path, 4, steps=STEPS)
    lora_ref = plain_reference(
        model_path, 4, steps=STEPS, wrap=lambda m: PeftModel.from_pretrained(m, adapter, is_trainable=True)
    )
    for name in ("tp2", "fsdp2", "tp2_lora_checkpointing"):
        assert got[name]["compiled"], name
        assert_parity(got[name]["steps"], lora_ref if "lora" in name else ref, label=f"{name} + compile")


def test_compiled_stages_match_one_process(pp_llama, compiled):
    """pp=2 (2 ranks, Llama with 4 blocks) under Interleaved1F1B with each stage's blocks compiled: one
    process's loss and grad_norm at every step."""
    run = compiled[0]["pp2_interleaved"]
    assert run["compiled"]
    assert_parity(run["steps"], pp_llama[1], label="pp2 Interleaved1F1B + compile")


def test_compile_without_a_compiler_is_one_line(model_path, tmp_path, monkeypatch):
    data = tmp_path / "d.txt"
    data.write_text("hello\n")
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ConfigError, match=r"train\.compile=true needs a C\+\+ compiler") as info:
        load_config(raw={"model": model_path, "data": {"path": str(data)}}, overrides=["train.compile=true"])
    assert "\n" not in str(info.value)
