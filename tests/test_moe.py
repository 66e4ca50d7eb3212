"""Mixture-of-experts under TP: experts split by their intermediate dim (``parallel/infer/experts.py``,
the ``experts`` style), trained exactly like one process.

Tiny models from each type's own config defaults (``scripts/tiny.py``: 4 experts, top-2, only
sizes shrunk): Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE (shared expert) and gpt-oss (interleaved
gate/up, expert biases). Reference: the plain transformers loop of ``helpers.plain_reference`` (fp32, the
default experts kernel, grouped_mm on CPU), 5 steps; tolerances of the issue: loss 1e-5 and
grad_norm 1e-4 relative.

Expert parallelism (``parallel.ep``, ``parallel/runtime/ep.py``): Qwen3-MoE, Mixtral and gpt-oss at
fsdp=2 x ep=2 in the module's one 2-rank spawn (with DCP resumes across ep=2 <-> ep=1 and
consolidation), Qwen3-MoE and gpt-oss at tp=2 x fsdp=2 x ep=2 in its one 4-rank spawn; Qwen3-MoE
and Mixtral at ep=2 alone (dp_replicate=2) and tp=2 x ep=2 (tp=2 x dp_replicate=2) in the same spawns.

Multi-head latent attention (``parallel/infer/latent.py``): DeepSeek-V3 (MLA, a shared expert, grouped
routing) and MiniCPM3 at tp=2, DeepSeek-V3 at fsdp=2 x ep=2 (with a DCP resume from tp=2 and
consolidation) in the same 2-rank spawn, and at tp=2 x fsdp=2 x ep=2 in the 4-rank one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    CountCollectives,
    assert_parity,
    model_collectives,
    plain_reference,
    run_ranks,
    shardlm_losses,
    token_dataset,
    train_config,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import tiny_config  # noqa: E402

# Qwen3-MoE, Mixtral, OLMoE (q/k norms across the width: sharded_norm), Qwen2-MoE (a shared
# expert, split like a dense MLP, and its 1-wide sigmoid gate, kept whole): gate_up concatenated
CONCAT = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"]
# gpt-oss: gate/up interleaved in a transposed [E, H, 2I], expert biases (the down bias added by one
# rank, its gradient summed over TP); its attention split by heads, each rank holding its heads' sinks
TRAINED = [*CONCAT, "gpt_oss"]
CONCATENATED = {"gate_up_proj": (1, 2, False), "down_proj": (2, 1, False)}  # [E, 2I, H], [E, H, I]


def _write(root: Path, model_type: str) -> str:
    path = root / model_type
    tiny_config(model_type).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {t: _write(root, t) for t in TRAINED}


def _meta(path: str):
    from shardlm.parallel.model.meta import build_meta_model

    return build_meta_model(path)


def _layout(entry: dict) -> dict:
    return {name: (p.dim, p.parts, p.once) for name, p in entry.items()}


def test_the_plan_derives_each_experts_layout(dirs):
    """Which parameter is the in/out projection, its intermediate dim, and gate/up concatenated (2
    parts) or interleaved (gpt-oss: 1 part, its down bias added once) come from the probe."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.infer.experts import find_experts
    from shardlm.parallel.plan.describe import describe_plan

    for model_type in CONCAT:
        plan = infer_plan(_meta(dirs[model_type]), 2)
        assert set(plan.experts) == {f"model.layers.{i}.mlp.experts" for i in range(2)}, model_type
        for fqn, entry in plan.experts.items():
            assert plan.styles[fqn] == "experts"
            assert _layout(entry) == CONCATENATED, (model_type, entry)
        gate = "model.layers.0.mlp.gate"
        assert plan.styles[gate] == "replicate_local", model_type  # the router: whole, on plain tensors
    plan = infer_plan(_meta(dirs["qwen2_moe"]), 2)
    rows = {row["module"]: row for row in describe_plan(_meta(dirs["qwen2_moe"]), plan, 2)}
    experts = rows["model.layers.0.mlp.experts"]  # `shardlm plan`'s table: the experts halved per rank
    assert experts["local"] == {"gate_up_proj": (4, 64, 64), "down_proj": (4, 64, 32)}
    assert 2 * experts["bytes_per_rank"] == experts["bytes_global"]
    assert "probed: gate_up_proj dim 1 in 2 parts, down_proj dim 2" in experts["source"]
    assert plan.styles["model.layers.0.mlp.shared_expert.gate_proj"] == "colwise"
    assert plan.styles["model.layers.0.mlp.shared_expert.down_proj"] == "rowwise"
    assert "1 output(s), fewer than tp=2" in plan.replicated["model.layers.0.mlp.shared_expert_gate"]
    # gpt-oss's experts ([E, H, 2I] with gate/up interleaved, biases); its attention is split by heads,
    # its per-head sinks with them (``per_channel``: tests/test_attention_split.py); its router computes
    # on local views
    plan = infer_plan(_meta(dirs["gpt_oss"]), 2)
    assert plan.styles["model.layers.0.self_attn"] == "per_channel"
    assert plan.styles["model.layers.0.mlp.router"] == "replicate_local"
    assert (
        plan.experts["model.layers.0.mlp.experts"]
        == find_experts(_meta(dirs["gpt_oss"]), 2)["model.layers.0.mlp.experts"]
    )
    assert _layout(plan.experts["model.layers.0.mlp.experts"]) == {
        "gate_up_proj": (2, 1, False),
        "gate_up_proj_bias": (1, 1, False),
        "down_proj": (1, 1, False),
        "down_proj_bias": (None, 1, True),
    }


def _split_sum(experts, layout: dict, tp: int, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole module's output, the sum of the outputs of ``tp`` ranks' pieces of ``layout``)."""
    from shardlm.parallel.infer.expert_split import local_positions

    whole = {n: p.detach().clone() for n, p in experts.named_parameters(recurse=False)}
    for p in whole.values():
        p.normal_(std=p.shape[-1] ** -0.5)  # the init leaves biases at zero: make every parameter count

    def run(params: dict) -> torch.Tensor:
        for name, value in params.items():
            experts._parameters[name] = torch.nn.Parameter(value)
        return experts(*inputs)

    want, total = run(whole), 0
    for rank in range(tp):
        pieces = {}
        for name, value in whole.items():
            p = layout[name]
            if p.dim is not None:
                value = value.index_select(p.dim, local_positions(value.shape[p.dim], p.parts, tp, rank))
            elif p.once and rank:
                value = torch.zeros_like(value)
            pieces[name] = value
        total = total + run(pieces)
    return want, total


@pytest.mark.parametrize("kernel", ["eager", "batched_mm", "grouped_mm"])
def test_split_experts_sum_to_the_whole_with_every_kernel(dirs, kernel):
    """The plan's pieces, run by each experts kernel on real numbers (a CPU model, not meta), sum
    to the whole module's output: what every TP rank computes, without processes. The plan came
    from the eager probe alone."""
    from transformers import AutoModelForCausalLM

    from shardlm.parallel.infer.experts import find_experts

    for model_type in TRAINED:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()  # grouped_mm takes no fp64
        model.set_experts_implementation(kernel)
        fqn = "model.layers.0.mlp.experts"
        layout = find_experts(_meta(dirs[model_type]), 2)[fqn]
        g = torch.Generator().manual_seed(1)
        x = torch.randn(7, config.hidden_size, generator=g)
        index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
        weights = torch.rand(7, 2, generator=g)
        want, total = _split_sum(model.get_submodule(fqn), layout, 2, (x, index, weights))
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5, msg=f"{model_type} {kernel}")


def test_experts_no_placement_reproduces_are_refused(tmp_path):
    """An experts module no placement reproduces is refused in one line naming it; per-expert linear modules
    are probed as the layer calling them runs them."""
    from shardlm.errors import ConfigError
    from shardlm.parallel.infer.experts import probe_layout

    meta = _meta(_write(tmp_path, "qwen3_moe"))
    experts = meta.get_submodule("model.layers.0.mlp.experts")
    # an expert width tp=3 cannot split (64 per expert): no candidate
    why = probe_layout(experts, meta.config.hidden_size, 3)
    assert isinstance(why, str) and "no split of its parameters" in why

    # a norm over the hidden width after the experts: partial sums cannot be normalized per rank
    class Normed(type(experts)):
        def forward(self, hidden, index, weights):
            out = super().forward(hidden, index, weights)
            return out / out.norm(dim=-1, keepdim=True)

    experts.__class__ = Normed
    why = probe_layout(experts, meta.config.hidden_size, 2)
    assert isinstance(why, str) and "reproduces its output" in why
    from shardlm.parallel.infer.experts import find_experts, whole_moe_layers

    with pytest.raises(ConfigError):
        find_experts(meta, 2)
    # experts as per-expert linear modules the layer calls itself (JetMoE, ``expert_layers.py``): its MLP split per
    # expert (gate|up rows in 2 parts, the down columns, the bias added once, the router whole); its mixture of
    # attention heads, called through map/reduce, split by the attention layer calling it: each expert's query
    # heads (input_linear rows) with their kv heads (kv_proj's k and v rows), output_linear's columns, the MoA's
    # query width local, its bias added once, the router whole; no MoE layer left whole
    meta = _meta(_write(tmp_path, "jetmoe"))
    found = find_experts(meta, 2)
    assert set(found) == {f"model.layers.{i}.{m}" for i in range(2) for m in ("mlp", "self_attention")}, found
    assert {n: (p.dim, p.parts, p.once) for n, p in found["model.layers.0.mlp"].items()} == {
        "bias": (None, 1, True),
        "input_linear.weight": (1, 2, False),
        "output_linear.weight": (2, 1, False),
    }
    assert {n: (p.dim, p.parts, p.once) for n, p in found["model.layers.0.self_attention"].items()} == {
        "experts.bias": (None, 1, True),
        "experts.input_linear.weight": (1, 1, False),
        "experts.output_linear.weight": (2, 1, False),
        "kv_proj.weight": (0, 2, False),
    }
    assert found["model.layers.0.self_attention"].local_sizes == {"experts": {"hidden_size": 32}}
    assert not whole_moe_layers(meta, found)


def _report(label: str, got: list, ref: list) -> None:
    """Print the largest relative differences (``pytest -s`` shows them: the measured parity)."""
    loss = max(abs(a - b) / abs(b) for (a, _), (b, _) in zip(got, ref))
    norm = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, ref))
    print(f"{label}: loss {loss:.1e}, grad_norm {norm:.1e} relative, {len(ref)} steps")


def _expert_bytes(model) -> tuple[int, int]:
    """(bytes of the experts' 3-D parameters on this rank, in the whole model), fp32 (gpt-oss's
    down bias, ``[E, H]``, is whole on every rank)."""
    local = whole = 0
    for fqn in model.plan.experts:
        for p in model.module.get_submodule(fqn).parameters(recurse=False):
            if p.dim() == 3:
                local += 4 * p.to_local().numel()
                whole += 4 * p.numel()
    return local, whole


def tp2_body(paths: list[str], router_paths: list[str]) -> tuple[dict, dict, dict, dict]:
    """Rank body (2 ranks): 5 steps of each model at tp=2, then the collectives of one micro-batch
    and the experts' bytes per rank; then the router-loss runs (``router_body``)."""
    from shardlm import build_mesh, parallelize
    from shardlm.config import ParallelConfig

    losses = shardlm_losses(paths, {"tp": 2}, 4, 1)
    mesh = build_mesh(ParallelConfig(tp=2))
    counts, sizes = {}, {}
    for path in paths:
        model = parallelize(path, mesh)
        counts[path] = model_collectives(model, mesh)
        sizes[path] = _expert_bytes(model)
    return losses, counts, sizes, router_body(router_paths)


@pytest.mark.ranks
def test_moe_at_tp2_matches_one_process_with_dense_communication(dirs, two_ranks):
    paths = [dirs[t] for t in TRAINED]
    losses, counts, sizes, _ = two_ranks["tp2"]
    for model_type, path in zip(TRAINED, paths):
        ref = plain_reference(path, 4)
        assert_parity(losses[path], ref, label=model_type)
        _report(f"{model_type} tp=2", losses[path], ref)
        print(f"{model_type} collectives per micro-batch (forward, loss, backward, partial grads): {counts[path]}")
        fwd, loss, bwd, grads = (sum(c.values()) for c in counts[path])
        kinds = {str(k) for c in counts[path][:3] for k in c}
        assert kinds == {"all_reduce"}, (model_type, kinds)
        # as a dense model: embedding 1 + (attention 1 + MoE 1) per block forward, the same backward
        # (the experts' input gradients, hidden states and routing weights, summed in one all-reduce);
        # OLMoE's q/k norms across the width add 2 per block each way (as OLMo-2's); Qwen2-MoE's
        # shared expert is a second MLP beside the experts: 1 more per block each way
        expected = {"olmoe": (9, 3, 9), "qwen2_moe": (7, 3, 7)}.get(model_type, (5, 3, 5))
        assert (fwd, loss, bwd) == expected, (model_type, fwd, loss, bwd)
        # one all-reduce per step of the TP-partial gradients: Qwen3's per-head q/k norms, gpt-oss's down bias
        assert grads == (model_type in ("qwen3_moe", "gpt_oss")), (model_type, grads)
        local, whole = sizes[path]
        print(f"{model_type} experts: {local} bytes per rank of {whole}")
        assert 2 * local == whole, (model_type, local, whole)


@pytest.mark.ranks
def test_moe_at_tp2_fsdp2_matches_one_process(dirs, router_dirs, mla_dirs):
    """The models above, and Mixtral and Qwen3-MoE with the router's load-balancing loss on
    (``ROUTER``), at tp=2 x fsdp=2; then the expert-parallel layouts (``four_ranks_body``)."""
    paths = [dirs[t] for t in TRAINED] + [router_dirs[t] for t in ROUTER]
    ep_paths, rep_paths = [dirs[t] for t in TP2_EP2_TRAINED], [dirs[t] for t in REP_EP_TRAINED]
    mla_paths = [mla_dirs["deepseek_v3"]]
    got, ep_got, rep_got, mla_got = run_ranks(four_ranks_body, 4, paths, ep_paths, rep_paths, mla_paths)
    for model_type, path in zip(TRAINED + [f"{t} +router loss" for t in ROUTER], paths):
        ref = plain_reference(path, 4)
        assert_parity(got[path], ref, label=model_type)
        _report(f"{model_type} tp=2 x fsdp=2", got[path], ref)
    check_tp2_ep2(ep_got)
    check_ep_layout(rep_got, TP2_REP_EP_LAYOUT)
    check_mla_tp2_ep2(mla_got)


# ---------------------------------------------------------------- the router's load-balancing loss

# with output_router_logits on and the family's own router_aux_loss_coef (train/router_loss.py)
ROUTER = ["mixtral", "qwen3_moe"]


@pytest.fixture(scope="module")
def router_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("router")
    out = {}
    for model_type in ROUTER:
        config = tiny_config(model_type)
        assert config.output_router_logits is False and config.router_aux_loss_coef > 0  # off by default
        config.output_router_logits = True
        config.save_pretrained(root / model_type)
        out[model_type] = str(root / model_type)
    return out


def router_body(paths: list[str]) -> dict:
    """Rank body (2 ranks, in ``tp2_body``'s job): 5 steps of each model at tp=2 and at fsdp=2
    (global batch 4); ``{(layout, path): [(loss, grad_norm, router_loss) per step]}``, and under
    ``("collectives", layout)`` the collectives of the router term of one micro-step."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    out = {}
    for layout, shape, per_device in (("tp=2", {"tp": 2}, 4), ("fsdp=2", {"fsdp": 2}, 2)):
        for path in paths:
            cfg = train_config(path, shape, per_device, 1, 5)
            mesh = build_mesh(cfg.parallel)
            trainer = Trainer(parallelize(path, mesh, seed=cfg.train.seed), cfg, token_dataset(), mesh)
            out[(layout, path)] = [(h["loss"], h["grad_norm"], h["router_loss"]) for h in trainer.train()]
        logits = tuple(torch.randn(8, trainer.router_loss.num_experts) for _ in range(2))
        mode = CountCollectives()
        with mode:
            trainer.router_loss.terms(logits, trainer.mesh.sum_over_dp)
        out[("collectives", layout)] = dict(mode.counts)
    return out


@pytest.mark.ranks
def test_router_loss_over_the_global_batch_matches_one_process(router_dirs, two_ranks):
    """Loss (language model + ``coef * aux_loss``) and grad_norm as one process computes them with
    the model's own ``outputs.aux_loss`` on the global batch, at tp=2 (the replicated router's term
    counted once) and fsdp=2 (the expert counts reduced over the ranks before the product); and the
    router term alone, a small share of the loss at the families' coefficient (0.001), to 1e-5 of
    itself: the mean of per-rank aux losses would miss it."""
    got = two_ranks["tp2"][3]
    for model_type in ROUTER:
        path, router_ref = router_dirs[model_type], []
        ref = plain_reference(path, 4, router_losses=router_ref)
        for layout in ("tp=2", "fsdp=2"):
            run, label = got[(layout, path)], f"{model_type} {layout} +router loss"
            assert_parity([(loss, norm) for loss, norm, _ in run], ref, label=label)
            _report(label, [(loss, norm) for loss, norm, _ in run], ref)
            router = max(abs(r - want) / abs(want) for (_, _, r), want in zip(run, router_ref))
            print(f"{label}: router term {router:.1e} relative (of {router_ref[0]:.3g} at step 1)")
            assert router <= 1e-5, (label, [r for _, _, r in run], router_ref)
    # per micro-step: one all-reduce of 2E + 1 values over the data-parallel ranks, none without them
    assert got[("collectives", "tp=2")] == {} and got[("collectives", "fsdp=2")] == {"allreduce_": 1}, got


# ---------------------------------------------------------------- expert parallelism (parallel.ep)

# the families the EP spawn trains: concatenated gate/up (Qwen3-MoE, Mixtral) and gpt-oss's interleaved
# [E, H, 2I] with expert biases
EP_TRAINED = ["qwen3_moe", "mixtral", "gpt_oss"]
EP_LAYOUT = {"fsdp": 2, "ep": 2}  # 2 ranks: each holds 2 of the 4 experts; ep carved out of fsdp
# ep=2 alone: carved out of dp_replicate=2 (dense parameters replicated, experts halved); in the same
# 2-rank spawn, and tp=2 x ep=2 (tp=2 x dp_replicate=2) in the 4-rank one
REP_EP_TRAINED = ["qwen3_moe", "mixtral"]
REP_EP_LAYOUT = {"dp_replicate": 2, "ep": 2}
TP2_REP_EP_LAYOUT = {"tp": 2, "dp_replicate": 2, "ep": 2}


def test_ep_values_are_checked_before_spawning(dirs, tmp_path):
    """One line each, naming the key: ep must divide fsdp or be a multiple of it dividing
    dp_replicate x fsdp (EP ranks are data-parallel ranks, fsdp first); with the model: ep must
    divide the expert count, and a dense model has nothing to divide."""
    from helpers import load_checked, write_model_dir

    from shardlm import ConfigError

    (tmp_path / "data.txt").write_text("hello world\n")
    data = {"path": str(tmp_path / "data.txt")}
    dense = write_model_dir(str(tmp_path / "llama"))
    cases = [
        (dirs["qwen3_moe"], {"fsdp": 2, "ep": 4}, None, r"parallel.ep=4 must divide parallel.fsdp=2 or be a multiple"),
        (dirs["qwen3_moe"], {"fsdp": 3, "dp_replicate": 2, "ep": 2}, None, r"ep=2 must divide parallel.fsdp=3"),
        (dirs["qwen3_moe"], {"fsdp": 2, "dp_replicate": 3, "ep": 4}, None, r"dividing dp_replicate\*fsdp=6"),
        (dirs["qwen3_moe"], {"fsdp": 3, "ep": 3}, None, r"parallel.ep=3 must divide the 4 experts of model.layers.0"),
        (dense, {"fsdp": 2, "ep": 2}, None, r"parallel.ep=2: LlamaForCausalLM has no fused mixture-of-experts"),
        (dirs["qwen3_moe"], {"ep": 0}, None, r"parallel.ep must be >= 1"),
    ]
    for model, parallel, lora, match in cases:
        raw = {"model": model, "data": data, "parallel": parallel, **({"lora": lora} if lora else {})}
        with pytest.raises(ConfigError, match=match) as info:
            load_checked(raw=raw)
        assert "\n" not in str(info.value)
    for layout in (EP_LAYOUT, REP_EP_LAYOUT, TP2_REP_EP_LAYOUT, {"fsdp": 2, "dp_replicate": 2, "ep": 4}):
        raw = {"model": dirs["qwen3_moe"], "data": data, "parallel": layout}
        assert load_checked(raw=raw).parallel.ep == layout["ep"]


def _ep_expert_bytes(model) -> tuple[int, int]:
    """(bytes of the experts' 3-D parameters on this rank, in the whole model), fp32 (under TP,
    gpt-oss's down bias ``[E, H]`` is whole over TP, halved only by EP)."""
    params = [model.module.get_parameter(n) for n in model.expert_grads]
    local = sum(4 * p.to_local().numel() for p in params if p.dim() == 3)
    return local, sum(4 * p.numel() for p in params if p.dim() == 3)


def _resume_run(path: str, ep: int, out: str, resume: str | None = None) -> list[float]:
    """4 steps at fsdp=2 (global batch 4), saving every 2: the losses."""
    from shardlm import Trainer, build_mesh, parallelize

    extra = {"resume": resume} if resume else {}
    cfg = train_config(path, {"fsdp": 2, "ep": ep}, 2, 1, 4, output_dir=out, save_steps=2, **extra)
    mesh = build_mesh(cfg.parallel)
    return [h["loss"] for h in Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh).train()]


@pytest.fixture(scope="module")
def two_ranks(dirs, router_dirs, mla_dirs, tmp_path_factory) -> dict:
    """The one 2-rank spawn of this module: the MoE models at tp=2 (``tp2_body``), then at
    fsdp=2 x ep=2 with checkpoints across ep sizes (``ep2_body``, writing under ``root``), at
    dp_replicate=2 x ep=2 (``ep_layout_body``), then the MLA models (``mla_body``, writing under
    ``root/mla``)."""
    root = tmp_path_factory.mktemp("ep")
    paths, ep_paths = [dirs[t] for t in TRAINED], [dirs[t] for t in EP_TRAINED]
    router_paths, rep_paths = [router_dirs[t] for t in ROUTER], [dirs[t] for t in REP_EP_TRAINED]
    mla_paths = [mla_dirs[t] for t in MLA]
    tp2, ep2, rep, mla = run_ranks(two_ranks_body, 2, paths, router_paths, ep_paths, str(root), rep_paths, mla_paths)
    return {"tp2": tp2, "ep2": ep2, "root": root, "rep_ep2": rep, "mla": mla}


def two_ranks_body(
    paths: list[str], router_paths: list[str], ep_paths: list[str], root: str, rep: list[str], mla_paths: list[str]
) -> tuple:
    return (
        tp2_body(paths, router_paths),
        ep2_body(ep_paths, root),
        ep_layout_body(rep, REP_EP_LAYOUT),
        mla_body(mla_paths, f"{root}/mla"),
    )


def ep_layout_body(paths: list[str], layout: dict) -> dict:
    """Rank body: 5 steps of each model at ``layout`` (global batch 4), the collectives of one
    micro-batch and the experts' bytes per rank: ``{path: (losses, collectives, bytes)}``."""
    from shardlm import build_mesh, parallelize
    from shardlm.config import ParallelConfig

    parallel = ParallelConfig(**layout)
    losses = shardlm_losses(paths, layout, 4 // parallel.dp_size, 1)
    mesh, out = build_mesh(parallel), {}
    for path in paths:
        model = parallelize(path, mesh)
        out[path] = (losses[path], model_collectives(model, mesh), _ep_expert_bytes(model))
    return out


def _check_ep_run(model_type: str, label: str, path: str, run: tuple, parts: int) -> tuple:
    """Parity of one EP run (losses, collective counts, experts' bytes) against one process, the
    experts divided into ``parts`` (ep x tp) per rank; its collective counts, reported."""
    losses, counts, (local, whole) = run
    ref = plain_reference(path, 4)
    assert_parity(losses, ref, label=f"{model_type} {label}")
    _report(f"{model_type} {label}", losses, ref)
    print(f"{model_type} {label} collectives per micro-batch (forward, loss, backward, grads): {counts}")
    print(f"{model_type} {label} experts: {local} bytes per rank of {whole}")
    assert parts * local == whole, (model_type, local, whole)
    return counts


def check_ep_layout(got: dict, layout: dict) -> None:
    """Parity of ``ep_layout_body``'s runs; the experts divided over ep x tp; per MoE layer (2 blocks)
    3 all-to-alls forward (counts, rows out, rows back), 2 backward (the rows' gradients); FSDP's
    all-reduce of the replicated gradients per group; under TP
    its all-reduces as at tp=2 (embedding 1 + attention 1 + MoE 1 per block, each way), once more
    for the TP-partial gradients of Qwen3's q/k norms."""
    label = " x ".join(f"{k}={v}" for k, v in layout.items())
    tp = layout.get("tp", 1)
    for model_type, path in zip(REP_EP_TRAINED, got):
        counts = _check_ep_run(model_type, label, path, got[path], layout["ep"] * tp)
        fwd, _, bwd, grads = counts
        assert fwd.get("all_to_all_single", 0) + fwd.get("alltoall_base_", 0) == 6, (model_type, fwd)
        assert bwd.get("all_to_all_single", 0) + bwd.get("alltoall_base_", 0) == 4, (model_type, bwd)
        # dense parameters replicated over dp_replicate: FSDP's one gradient all-reduce per group
        # (2 blocks and the root), nothing gathered or scattered
        assert bwd["allreduce_"] == 3 and not {"all_gather_into_tensor", "reduce_scatter_tensor"} & {*fwd, *bwd}
        if tp > 1:
            assert fwd["all_reduce"] == bwd["all_reduce"] == 5, (model_type, counts)
            assert sum(grads.values()) == (model_type == "qwen3_moe"), (model_type, grads)


@pytest.mark.ranks
def test_moe_at_ep2_alone_matches_one_process(two_ranks):
    """ep=2 without fsdp: the 2 ranks are dp_replicate=2 (dense parameters replicated), the experts
    halved between them."""
    check_ep_layout(two_ranks["rep_ep2"], REP_EP_LAYOUT)


def ep2_body(paths: list[str], root: str) -> tuple[dict, dict, dict, dict]:
    """Rank body (2 ranks): 5 steps of each model at fsdp=2 x ep=2; the collectives of one
    micro-batch and the experts' bytes per rank; then checkpoints across ep sizes (the first
    model): ep=2 saved -> ep=1 resumed, and ep=1 saved -> ep=2 resumed."""
    from shardlm import build_mesh, parallelize
    from shardlm.config import ParallelConfig

    losses = shardlm_losses(paths, EP_LAYOUT, 2, 1)
    mesh = build_mesh(ParallelConfig(**EP_LAYOUT))
    counts, sizes = {}, {}
    for path in paths:
        model = parallelize(path, mesh)
        counts[path] = model_collectives(model, mesh)
        sizes[path] = _ep_expert_bytes(model)
    runs = {"ep2": _resume_run(paths[0], 2, f"{root}/ep2"), "ep1": _resume_run(paths[0], 1, f"{root}/ep1")}
    runs["ep2_to_ep1"] = _resume_run(paths[0], 1, f"{root}/ep2_to_ep1", f"{root}/ep2/checkpoints/step-2")
    runs["ep1_to_ep2"] = _resume_run(paths[0], 2, f"{root}/ep1_to_ep2", f"{root}/ep1/checkpoints/step-2")
    return losses, counts, sizes, runs


@pytest.mark.ranks
def test_moe_at_ep2_matches_one_process_and_resumes_across_ep(dirs, two_ranks, tmp_path):
    """fsdp=2 x ep=2: each rank holds half of every layer's experts, tokens travel by all-to-all;
    5 steps equal one process (loss 1e-5, grad_norm 1e-4). Checkpoints saved at ep=2 resume at
    ep=1 and the other way round with the losses of the uninterrupted run (1e-5), and
    ``shardlm consolidate`` of the ep=2 checkpoint gives the ep=1 run's weights."""
    from safetensors.torch import load_file

    from shardlm.cli import main

    paths, root = [dirs[t] for t in EP_TRAINED], two_ranks["root"]
    losses, counts, sizes, runs = two_ranks["ep2"]
    for model_type, path in zip(EP_TRAINED, paths):
        ref = plain_reference(path, 4)
        assert_parity(losses[path], ref, label=model_type)
        _report(f"{model_type} fsdp=2 x ep=2", losses[path], ref)
        print(f"{model_type} collectives per micro-batch (forward, loss, backward, partial grads): {counts[path]}")
        local, whole = sizes[path]
        print(f"{model_type} experts: {local} bytes per rank of {whole}")
        assert 2 * local == whole, (model_type, local, whole)
        fwd, _, bwd, _ = counts[path]
        # per MoE layer (2 blocks): forward 2 all-to-alls of the counts and rows' way there and back
        # (3: counts, rows out, rows back), backward 2 (the rows' gradients); FSDP's own collectives beside
        assert fwd.get("all_to_all_single", 0) + fwd.get("alltoall_base_", 0) == 6, (model_type, fwd)
        assert bwd.get("all_to_all_single", 0) + bwd.get("alltoall_base_", 0) == 4, (model_type, bwd)
    for a, b in zip(runs["ep2"], runs["ep1"]):
        assert abs(a - b) <= 1e-5 * abs(b), (runs["ep2"], runs["ep1"])
    for resumed, full in (("ep2_to_ep1", "ep2"), ("ep1_to_ep2", "ep1")):
        assert len(runs[resumed]) == 2, runs[resumed]
        for a, b in zip(runs[resumed], runs[full][2:]):
            assert abs(a - b) <= 1e-5 * abs(b), (resumed, runs[resumed], runs[full])
    weights = {}
    for run in ("ep2", "ep1"):
        out = str(tmp_path / f"hf_{run}")
        assert main(["consolidate", str(root / run / "checkpoints" / "step-4"), out]) == 0
        weights[run] = {k: v for f in sorted(Path(out).glob("*.safetensors")) for k, v in load_file(f).items()}
    assert weights["ep2"].keys() == weights["ep1"].keys() and any("experts" in k for k in weights["ep2"])
    for key, value in weights["ep2"].items():
        torch.testing.assert_close(value, weights["ep1"][key], rtol=1e-4, atol=1e-6, msg=key)


# tp=2 x ep=2 (4 ranks, in the 4-rank spawn above): Qwen3-MoE (gate/up halves each split over TP
# inside the experts each EP rank holds: Shard(0) x _StridedShard) and gpt-oss (expert biases, the
# down bias added by one TP rank)
TP2_EP2_TRAINED = ["qwen3_moe", "gpt_oss"]
TP2_EP2_LAYOUT = {"tp": 2, "fsdp": 2, "ep": 2}
FSDP4_EP2_LAYOUT = {"fsdp": 4, "ep": 2}  # ep carved out of fsdp=4: efsdp=2 ranks hold the same experts


def four_ranks_body(
    paths: list[str], ep_paths: list[str], rep_paths: list[str], mla_paths: list[str]
) -> tuple[dict, dict, dict, dict]:
    """Rank body (4 ranks): ``paths`` at tp=2 x fsdp=2, then ``ep_paths`` at tp=2 x fsdp=2 x ep=2
    (with the collectives of one micro-batch and the experts' bytes per rank), then the first of
    them at fsdp=4 x ep=2 (experts held by 2 ranks each: their gradients summed over those 2), then
    ``rep_paths`` at tp=2 x ep=2 (ep carved out of dp_replicate=2), then the MLA models
    ``mla_paths`` at tp=2 x fsdp=2 x ep=2."""
    from shardlm import build_mesh, parallelize
    from shardlm.config import ParallelConfig

    losses = shardlm_losses(paths, {"tp": 2, "fsdp": 2}, 2, 1)
    ep_losses = shardlm_losses(ep_paths, TP2_EP2_LAYOUT, 2, 1)
    mesh = build_mesh(ParallelConfig(**TP2_EP2_LAYOUT))
    out = {}
    for path in ep_paths:
        model = parallelize(path, mesh)
        out[path] = (ep_losses[path], model_collectives(model, mesh), _ep_expert_bytes(model))
    out["fsdp4_ep2"] = shardlm_losses(ep_paths[:1], FSDP4_EP2_LAYOUT, 1, 1)[ep_paths[0]]
    rep = ep_layout_body(rep_paths, TP2_REP_EP_LAYOUT)
    return losses, out, rep, shardlm_losses(mla_paths, TP2_EP2_LAYOUT, 2, 1)


def check_tp2_ep2(got: dict) -> None:
    fsdp4, ref = got.pop("fsdp4_ep2"), plain_reference(next(iter(got)), 4)
    assert_parity(fsdp4, ref, label=f"{TP2_EP2_TRAINED[0]} fsdp=4 x ep=2")
    _report(f"{TP2_EP2_TRAINED[0]} fsdp=4 x ep=2", fsdp4, ref)
    for model_type, path in zip(TP2_EP2_TRAINED, got):
        counts = _check_ep_run(model_type, "tp=2 x fsdp=2 x ep=2", path, got[path], 4)
        fwd, _, bwd, grads = counts
        # TP's all-reduces as at tp=2 (embedding 1 + attention 1 + MoE 1 per block), each way; the
        # TP-partial gradients (Qwen3's q/k norms, gpt-oss's down bias) once
        assert fwd["all_reduce"] == bwd["all_reduce"] == 5, (model_type, counts)
        assert sum(grads.values()) == 1, (model_type, grads)
        assert fwd.get("all_to_all_single", 0) + fwd.get("alltoall_base_", 0) == 6, (model_type, fwd)
        assert bwd.get("all_to_all_single", 0) + bwd.get("alltoall_base_", 0) == 4, (model_type, bwd)


def test_plan_shows_the_experts_per_rank(dirs, capsys):
    """``shardlm plan --ep``: each rank's experts and their bytes (TP's split inside each expert too)."""
    from shardlm.cli import main

    assert main(["plan", dirs["qwen3_moe"], "--tp", "1", "--ep", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "experts model.layers.0.mlp.experts: 2 of 4 experts per rank (ep=2, tp=1): gate_up_proj 2x128x64, "
        "down_proj 2x64x64; 0.094 MB per rank of 0.188 MB"
    )
    assert main(["plan", dirs["gpt_oss"], "--tp", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("experts model.layers.0.mlp.experts: 2 of 4 experts per rank (ep=2, tp=2)"), out[0]
    assert "down_proj_bias 2x64" in out[0], out[0]  # the bias after the down projection: whole over TP
    assert main(["plan", dirs["qwen3_moe"], "--tp", "1", "--ep", "3"]) == 2
    assert "parallel.ep=3 must divide the 4 experts" in capsys.readouterr().err


def test_estimate_counts_the_experts_per_rank(dirs):
    """``shardlm estimate --ep``: the experts are divided over ep (not chunked by FSDP), and FSDP
    neither gathers nor reduce-scatters them."""
    from shardlm.estimate.memory import estimate

    c = tiny_config("qwen3_moe")
    experts = c.num_hidden_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size  # elements
    base, ep = estimate(dirs["qwen3_moe"], fsdp=4), estimate(dirs["qwen3_moe"], fsdp=4, ep=2)
    assert ep.params_local - base.params_local == experts // 2 - experts // 4
    assert base.bytes["compute_weights"] - ep.bytes["compute_weights"] == 4 * experts  # root + 2 blocks: all
    assert base.bytes["reduce_scatter"] - ep.bytes["reduce_scatter"] == 4 * experts // c.num_hidden_layers
    assert estimate(dirs["qwen3_moe"], fsdp=2, ep=2).params_local == estimate(dirs["qwen3_moe"], fsdp=2).params_local


# ---------------------------------------------------------------- multi-head latent attention (MLA)

# DeepSeek-V3: MLA, a shared expert, grouped routing (e_score_correction_bias, routed_scaling_factor,
# norm_topk_prob as published); tiny.py keeps its first layer dense and the second MoE. MiniCPM3: MLA in
# a dense model. GLM-4-MoE-lite's attention is DeepSeek-V3's (planned only).
MLA = ["deepseek_v3", "minicpm3"]
MLA_PLANNED = [*MLA, "glm4_moe_lite"]


@pytest.fixture(scope="module")
def mla_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mla")
    out = {}
    for model_type in MLA_PLANNED:
        config = tiny_config(model_type)
        if model_type == "deepseek_v3":
            assert config.first_k_dense_replace == 1 < config.num_hidden_layers  # one dense, one MoE layer
            # grouped routing kept: tiny.py's 4 experts in 2 groups, each token's best group only
            # (the family's 8 groups of 32, top 4 groups, shrunk; tiny.py's n_group=1 would not group)
            config.n_group, config.topk_group = 2, 1
        config.save_pretrained(root / model_type)
        out[model_type] = str(root / model_type)
    return out


def test_mla_plan_splits_the_heads_after_the_latents(mla_dirs):
    """The latents (``q_a_proj``, ``kv_a_proj_with_mqa``) whole on every rank, their norms summing
    their gradients over TP, the per-head up-projections column-parallel (half of their bytes per
    rank), ``o_proj`` row-parallel; nothing kept replicated; the router whole."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.plan.describe import describe_plan

    for model_type in MLA_PLANNED:
        meta = _meta(mla_dirs[model_type])
        plan = infer_plan(meta, 2)
        rows = {row["module"]: row for row in describe_plan(meta, plan, 2)}
        attn = "model.layers.1.self_attn"
        assert plan.replicated == {}, (model_type, plan.replicated)
        for latent in ("q_a_proj", "kv_a_proj_with_mqa"):
            fqn = f"{attn}.{latent}"
            assert plan.sliced[fqn] == [[(0, meta.get_submodule(fqn).out_features)]] * 2, model_type
            assert rows[fqn]["bytes_per_rank"] == rows[fqn]["bytes_global"]
        for norm in ("q_a_layernorm", "kv_a_layernorm"):
            assert plan.styles[f"{attn}.{norm}"] == "replicate_grad_allreduce", model_type
        for up, latent in (("q_b_proj", "q_a_proj"), ("kv_b_proj", "kv_a_proj_with_mqa")):
            fqn = f"{attn}.{up}"
            assert plan.styles[fqn] == "colwise" and plan.latent_readers[fqn] == f"{attn}.{latent}", model_type
            assert 2 * rows[fqn]["bytes_per_rank"] == rows[fqn]["bytes_global"], model_type
        assert plan.styles[f"{attn}.o_proj"] == "rowwise", model_type
    plan = infer_plan(_meta(mla_dirs["deepseek_v3"]), 2)
    assert plan.styles["model.layers.0.mlp.down_proj"] == "rowwise"  # the dense first layer
    assert plan.styles["model.layers.1.mlp.experts"] == "experts"
    assert plan.styles["model.layers.1.mlp.gate"] == "replicate_local"  # grouped top-k router, whole
    assert plan.styles["model.layers.1.mlp.shared_experts.down_proj"] == "rowwise"


def test_a_latent_whose_gradient_would_leak_is_kept_replicated(mla_dirs, monkeypatch):
    """A latent's tensors carry each rank's partial gradient: one that meets a tensor computed whole
    on every rank (here added to the attention's output) is no latent; the attention is then kept
    replicated, sub-block by sub-block, and trains as before."""
    from transformers.models.minicpm3 import modeling_minicpm3

    from shardlm.parallel.infer import autotp

    original = modeling_minicpm3.MiniCPM3Attention.forward

    def leaking(self, hidden_states, *args, **kwargs):
        out, weights = original(self, hidden_states, *args, **kwargs)
        return out + 0 * self.kv_a_proj_with_mqa(hidden_states).sum(), weights

    monkeypatch.setattr(modeling_minicpm3.MiniCPM3Attention, "forward", leaking)
    monkeypatch.setattr(autotp, "PLANS", {})  # not the plan of the model as published
    plan = autotp.infer_plan(_meta(mla_dirs["minicpm3"]), 2)
    attn = "model.layers.0.self_attn"
    assert not plan.latent_readers and not plan.sliced
    assert (
        "a low-rank latent: add mixes it with a tensor computed whole" in plan.replicated[f"{attn}.kv_a_proj_with_mqa"]
    )
    assert {plan.styles[f"{attn}.{n}"] for n in ("q_a_proj", "q_b_proj", "kv_b_proj", "o_proj")} == {"replicate_local"}
    assert plan.styles["model.layers.0.mlp.down_proj"] == "rowwise"


def _mla_bytes(model) -> dict[str, tuple[int, int]]:
    """fp32 bytes of the first block's MLA projections on this rank and in the whole model."""
    out = {}
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        weight = model.module.get_submodule(f"model.layers.0.self_attn.{name}").weight
        out[name] = (4 * weight.to_local().numel(), 4 * weight.numel())
    return out


def _mla_run(path: str, layout: dict, per_device: int, out: str, resume: str | None = None) -> list[float]:
    """4 steps (global batch 4), saving every 2: the losses."""
    from shardlm import Trainer, build_mesh, parallelize

    extra = {"resume": resume} if resume else {}
    cfg = train_config(path, layout, per_device, 1, 4, output_dir=out, save_steps=2, **extra)
    mesh = build_mesh(cfg.parallel)
    return [h["loss"] for h in Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh).train()]


def mla_body(paths: list[str], root: str) -> dict:
    """Rank body (2 ranks): 5 steps of each MLA model at tp=2, the collectives of one micro-batch
    and the projections' bytes per rank; DeepSeek-V3 (the first) at fsdp=2 x ep=2, and a checkpoint
    saved at tp=2 resumed at fsdp=2 x ep=2."""
    from shardlm import build_mesh, parallelize
    from shardlm.config import ParallelConfig

    out = {"tp2": shardlm_losses(paths, {"tp": 2}, 4, 1)}
    mesh = build_mesh(ParallelConfig(tp=2))
    for path in paths:
        model = parallelize(path, mesh)
        out[path] = (model_collectives(model, mesh), _mla_bytes(model))
    out["ep2"] = shardlm_losses(paths[:1], EP_LAYOUT, 2, 1)[paths[0]]
    out["tp2_run"] = _mla_run(paths[0], {"tp": 2}, 4, f"{root}/tp2")
    out["tp2_to_ep2"] = _mla_run(paths[0], EP_LAYOUT, 2, f"{root}/tp2_to_ep2", f"{root}/tp2/checkpoints/step-2")
    return out


@pytest.mark.ranks
def test_mla_at_tp2_and_ep2_matches_one_process(mla_dirs, two_ranks, tmp_path):
    """tp=2: 5 steps equal one process (loss 1e-5, grad_norm 1e-4), each rank holding half of the
    up-projections and ``o_proj``, the latents whole; one all-reduce per attention forward (o_proj)
    and backward (the latents' and every other column-parallel input, on one view). DeepSeek-V3 at
    fsdp=2 x ep=2 equals one process too; its tp=2 checkpoint resumes at fsdp=2 x ep=2 with the
    uninterrupted run's losses, and consolidates into files ``from_pretrained`` reads."""
    from transformers import AutoModelForCausalLM

    from shardlm.cli import main

    got, root = two_ranks["mla"], two_ranks["root"] / "mla"
    for model_type in MLA:
        path = mla_dirs[model_type]
        ref = plain_reference(path, 4)
        assert_parity(got["tp2"][path], ref, label=f"{model_type} tp=2")
        _report(f"{model_type} tp=2", got["tp2"][path], ref)
        counts, sizes = got[path]
        print(f"{model_type} collectives per micro-batch (forward, loss, backward, partial grads): {counts}")
        print(f"{model_type} first block's MLA weights, bytes per rank / whole: {sizes}")
        fwd, loss, bwd, grads = (sum(c.values()) for c in counts)
        assert {str(k) for c in counts[:3] for k in c} == {"all_reduce"}, counts
        # embedding/LM head 1 + per block: attention 1, MLP 1 (DeepSeek-V3's MoE layer: experts 1 +
        # shared experts 1); the latents' and norms' partial gradients summed once per step
        expected = (6, 3, 6) if model_type == "deepseek_v3" else (5, 3, 5)
        assert (fwd, loss, bwd) == expected and grads == 1, (model_type, counts)
        for name, (local, whole) in sizes.items():
            assert local * (1 if name.endswith("_a_proj") or name.endswith("mqa") else 2) == whole, (name, sizes)
    path = mla_dirs["deepseek_v3"]
    ref = plain_reference(path, 4)
    assert_parity(got["ep2"], ref, label="deepseek_v3 fsdp=2 x ep=2")
    _report("deepseek_v3 fsdp=2 x ep=2", got["ep2"], ref)
    resumed, full = got["tp2_to_ep2"], got["tp2_run"]
    assert len(resumed) == 2 and len(full) == 4, (resumed, full)
    for a, b in zip(resumed, full[2:]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed, full)
    out = str(tmp_path / "hf")
    assert main(["consolidate", str(root / "tp2" / "checkpoints" / "step-4"), out]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 4


def check_mla_tp2_ep2(got: dict) -> None:
    """DeepSeek-V3 at tp=2 x fsdp=2 x ep=2 (from ``four_ranks_body``)."""
    for path, losses in got.items():
        ref = plain_reference(path, 4)
        assert_parity(losses, ref, label="deepseek_v3 tp=2 x fsdp=2 x ep=2")
        _report("deepseek_v3 tp=2 x fsdp=2 x ep=2", losses, ref)


def test_lora_on_a_latent_reader_is_refused_by_name(mla_dirs, tmp_path):
    """LoRA on a per-head up-projection that reads a latent (its input gradient left partial) is
    refused before spawning, in one line naming it."""
    from helpers import load_checked

    from shardlm import ConfigError

    (tmp_path / "data.txt").write_text("hello world\n")
    raw = {
        "model": mla_dirs["minicpm3"],
        "data": {"path": str(tmp_path / "data.txt")},
        "parallel": {"tp": 2},
        "lora": {"target_modules": ["q_b_proj"]},
    }
    with pytest.raises(ConfigError, match=r"lora.target_modules: '.*q_b_proj' reads the low-rank latent") as info:
        load_checked(raw=raw)
    assert "\n" not in str(info.value)
