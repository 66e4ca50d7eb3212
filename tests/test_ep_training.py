"""Expert parallelism with the rest of training: LoRA, the router's load-balancing loss, bf16 and
activation checkpointing, each against one process (``parallel/runtime/ep.py``; the EP layouts themselves
and their collectives: ``test_moe.py``).

One 2-rank job (fsdp=2 x ep=2) and one shorter 4-rank job (tp=2 x fsdp=2 x ep=2) on the pooled
processes.
LoRA: Qwen2-MoE (attention and the shared expert's projections adapted, the routed experts frozen
and divided over ep) against one-process peft. Router loss: Mixtral and Qwen3-MoE with
``output_router_logits`` on, against one process's ``loss + coef * aux_loss`` on the global batch.
Both: loss 1e-5 and grad_norm 1e-4 relative over 5 steps, as ``test_moe.py``. bf16: within the 5%
per step ``test_trainer.py`` allows bf16 against fp32; activation checkpointing: the same numbers
as without (1e-6), the MoE block run twice per step (forward, recompute).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import assert_parity, make_adapter, run_ranks
from test_lora import assert_same_grads, lora_rank, peft_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import tiny_config  # noqa: E402

# attention and the shared expert's MLP (the router ``gate`` and the shared expert's 1-wide gate are
# not projections peft adapts here; the routed experts are fused 3-D parameters)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EP2 = {"fsdp": 2, "ep": 2}
TP2_EP2 = {"tp": 2, "fsdp": 2, "ep": 2}
ROUTER = ["mixtral", "qwen3_moe"]  # output_router_logits on, the family's own router_aux_loss_coef


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """``{name: model dir}``: Qwen3-MoE, and each ``ROUTER`` family with its router loss on (``+router``)."""
    root, out = tmp_path_factory.mktemp("ep_models"), {}
    tiny_config("qwen3_moe").save_pretrained(root / "qwen3_moe")
    out["qwen3_moe"] = str(root / "qwen3_moe")
    for model_type in ROUTER:
        config = tiny_config(model_type)
        config.output_router_logits = True
        config.save_pretrained(root / f"{model_type}+router")
        out[f"{model_type}+router"] = str(root / f"{model_type}+router")
    return out


def _run(path: str, layout: dict, steps: int = 5, **train) -> list[tuple]:
    """Rank body part: ``steps`` steps of shardlm at ``layout`` (global batch 4): (loss, grad_norm,
    router term or None) per step; ``train.bf16`` through FSDP's policy as ``shardlm train`` does."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.train.trainer import mixed_precision_policy

    init_distributed()
    cfg = train_config(path, layout, 2, 1, steps, **train)
    mesh = build_mesh(cfg.parallel)
    model = parallelize(path, mesh, seed=cfg.train.seed, mp_policy=mixed_precision_policy(cfg.train))
    trainer = Trainer(model, cfg, token_dataset(), mesh)
    calls = []
    # the first MoE block's runs: forward, and its recompute in the backward under checkpointing
    trainer.module.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    history = trainer.train()
    return [(h["loss"], h["grad_norm"], h.get("router_loss")) for h in history], len(calls)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("ep_lora")
    path = str(root / "qwen2_moe")
    tiny_config("qwen2_moe").save_pretrained(path)
    return path, make_adapter(path, str(root / "adapter"), LORA_TARGETS)


def ranks_body(lora: tuple[str, str], models: dict[str, str], layout: dict, full: bool) -> dict:
    """Rank body: LoRA, the router loss, bf16 at ``layout``; with ``full`` (the 2-rank job) also
    Mixtral's router loss, and Qwen3-MoE in fp32 and with activation checkpointing (the 4-rank job
    keeps to what TP adds: its bf16 run is compared with one process directly)."""
    out = {"lora": lora_rank([lora], layout, 2)[lora[0]]}
    for name in ROUTER if full else ROUTER[1:]:
        out[name] = _run(models[f"{name}+router"], layout)
    out["bf16"] = _run(models["qwen3_moe"], layout, bf16=True)
    if full:
        out["fp32"] = _run(models["qwen3_moe"], layout)
        out["checkpointing"] = _run(models["qwen3_moe"], layout, gradient_checkpointing=True)
    return out


@pytest.fixture(scope="module")
def two_ranks(lora_run, models) -> dict:
    return run_ranks(ranks_body, 2, lora_run, models, EP2, True)


@pytest.fixture(scope="module")
def four_ranks(lora_run, models) -> dict:
    return run_ranks(ranks_body, 4, lora_run, models, TP2_EP2, False)


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
    ref, _, ref_grads = peft_reference(*lora_run)
    label = f"qwen2_moe LoRA {EP2 if spawn == 'two_ranks' else TP2_EP2}"
    assert_parity(got["steps"], ref, label=label)
    assert_same_grads(got["grads"], ref_grads, label)
    _report(label, got["steps"], ref)
    assert got["tp_same"], label


@pytest.mark.ranks
@pytest.mark.parametrize("spawn", ["two_ranks", "four_ranks"])
def test_router_loss_under_ep_matches_one_process(models, spawn, request):
    """The load-balancing loss over the global batch with the experts divided over ep: the router
    is whole on every rank and sees its rank's tokens before any dispatch, so its statistics are
    summed over the data-parallel ranks as without EP; the term alone to 1e-5 of itself."""
    from helpers import plain_reference

    got = request.getfixturevalue(spawn)
    layout = EP2 if spawn == "two_ranks" else TP2_EP2
    for model_type in [t for t in ROUTER if t in got]:
        run, _ = got[model_type]
        router_ref = []
        ref = plain_reference(models[f"{model_type}+router"], 4, router_losses=router_ref)
        label = f"{model_type} {layout} +router loss"
        assert_parity([(loss, norm) for loss, norm, _ in run], ref, label=label)
        _report(label, [(loss, norm) for loss, norm, _ in run], ref)
        router = max(abs(r - want) / abs(want) for (_, _, r), want in zip(run, router_ref))
        print(f"{label}: router term {router:.1e} relative")
        assert router <= 1e-5, (label, [r for _, _, r in run], router_ref)


@pytest.mark.ranks
@pytest.mark.parametrize("spawn", ["two_ranks", "four_ranks"])
def test_bf16_under_ep_tracks_fp32(models, spawn, request):
    """bf16 (FSDP's policy casts the dense weights, the dispatch casts each rank's experts) within
    5% per step of fp32: the fp32 run of the same layout (2 ranks), one process in fp32 (4 ranks)."""
    from helpers import plain_reference

    got = request.getfixturevalue(spawn)
    bf16 = [loss for loss, _, _ in got["bf16"][0]]
    if "fp32" in got:
        fp32 = [loss for loss, _, _ in got["fp32"][0]]
        assert_parity([(loss, norm) for loss, norm, _ in got["fp32"][0]], plain_reference(models["qwen3_moe"], 4))
    else:
        fp32 = [loss for loss, _ in plain_reference(models["qwen3_moe"], 4)]
    for step, (b, f) in enumerate(zip(bf16, fp32, strict=True), start=1):
        assert abs(b - f) <= 0.05 * abs(f), f"{spawn} step {step}: bf16 loss {b} vs fp32 {f}"
    assert bf16 != fp32  # bf16 really computed something else
    print(f"{spawn} bf16: loss {max(abs(b - f) / f for b, f in zip(bf16, fp32)):.1e} relative to fp32")


@pytest.mark.ranks
def test_activation_checkpointing_under_ep_changes_nothing(two_ranks):
    """Activation checkpointing reruns the MoE block's dispatch (its all-to-alls) in the backward
    and gives the numbers of the run without it (1e-6)."""
    (fp32, calls), (ac, ac_calls) = two_ranks["fp32"], two_ranks["checkpointing"]
    for step, (a, f) in enumerate(zip(ac, fp32, strict=True), start=1):
        assert abs(a[0] - f[0]) <= 1e-6 * f[0] and abs(a[1] - f[1]) <= 1e-6 * f[1], (step, a, f)
    assert ac_calls == 10 and calls == 5, (ac_calls, calls)  # 5 steps x (forward + recompute)


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
