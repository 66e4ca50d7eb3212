"""Expert parallelism with the rest of training: LoRA, the router's load-balancing loss, bf16 and
activation checkpointing, each against one process (``parallel/ep.py``; the EP layouts themselves
and their collectives: ``test_moe.py``).

One 2-rank job (fsdp=2 x ep=2) and one 4-rank job (tp=2 x fsdp=2 x ep=2) on the pooled processes.
LoRA: Qwen2-MoE (attention and the shared expert's projections adapted, the routed experts frozen
and divided over ep) against one-process peft, loss 1e-5 and grad_norm 1e-4 relative over 5 steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import assert_parity, make_adapter, run_ranks
from test_lora import lora_rank, peft_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import tiny_config  # noqa: E402

# attention and the shared expert's MLP (the router ``gate`` and the shared expert's 1-wide gate are
# not projections peft adapts here; the routed experts are fused 3-D parameters)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EP2 = {"fsdp": 2, "ep": 2}
TP2_EP2 = {"tp": 2, "fsdp": 2, "ep": 2}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("ep_lora")
    path = str(root / "qwen2_moe")
    tiny_config("qwen2_moe").save_pretrained(path)
    return path, make_adapter(path, str(root / "adapter"), LORA_TARGETS)


def two_ranks_body(lora: tuple[str, str]) -> dict:
    """Rank body (2 ranks): LoRA at fsdp=2 x ep=2."""
    return {"lora": lora_rank([lora], EP2, 2)[lora[0]]}


def four_ranks_body(lora: tuple[str, str]) -> dict:
    """Rank body (4 ranks): LoRA at tp=2 x fsdp=2 x ep=2."""
    return {"lora": lora_rank([lora], TP2_EP2, 2)[lora[0]]}


@pytest.fixture(scope="module")
def two_ranks(lora_run) -> dict:
    return run_ranks(two_ranks_body, 2, lora_run)


@pytest.fixture(scope="module")
def four_ranks(lora_run) -> dict:
    return run_ranks(four_ranks_body, 4, lora_run)


def _report(label: str, got: list, ref: list) -> None:
    loss = max(abs(a - b) / abs(b) for (a, _), (b, _) in zip(got, ref))
    norm = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, ref))
    print(f"{label}: loss {loss:.1e}, grad_norm {norm:.1e} relative, {len(ref)} steps")


@pytest.mark.ranks
@pytest.mark.parametrize("spawn", ["two_ranks", "four_ranks"])
def test_lora_under_ep_matches_one_process_peft(lora_run, spawn, request):
    """Adapters on attention and on the shared expert train as one-process peft trains them, the
    frozen routed experts divided over ep; replicated adapters stay identical on TP ranks."""
    got = request.getfixturevalue(spawn)["lora"]
    ref, _ = peft_reference(*lora_run)
    label = f"qwen2_moe LoRA {EP2 if spawn == 'two_ranks' else TP2_EP2}"
    assert_parity(got["steps"], ref, label=label)
    _report(label, got["steps"], ref)
    assert got["tp_same"], label


def test_lora_on_the_routed_experts_is_refused_by_name(lora_run, tmp_path):
    """Before spawning, one line each: the experts as a LoRA target (fused 3-D parameters, not a
    linear layer), a ``modules_to_save`` copy holding the experts under ep, and a peft adapter
    made with ``target_parameters`` (peft's LoRA on fused parameters)."""
    import json
    import shutil

    from helpers import load_checked

    from shardlm import ConfigError

    path, adapter = lora_run
    (tmp_path / "d.txt").write_text("a b c\n")
    raw = {"model": path, "data": {"path": str(tmp_path / "d.txt")}, "parallel": EP2}
    assert load_checked(raw={**raw, "lora": {"target_modules": LORA_TARGETS}}).lora is not None
    params = tmp_path / "params"
    shutil.copytree(adapter, params)
    config = json.loads((params / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.gate_up_proj"]
    (params / "adapter_config.json").write_text(json.dumps(config))
    cases = [
        ({"target_modules": ["experts"]}, "'model.layers.0.mlp.experts' is a Qwen2MoeExperts, which peft cannot"),
        ({"target_modules": ["q_proj"], "modules_to_save": ["mlp"]}, "'model.layers.0.mlp' holds routed experts"),
        ({"adapter": str(params)}, "uses target_parameters, which shardlm does not place"),
    ]
    for lora, match in cases:
        with pytest.raises(ConfigError, match=match) as info:
            load_checked(raw={**raw, "lora": lora})
        assert "\n" not in str(info.value), info.value
        print(info.value)
