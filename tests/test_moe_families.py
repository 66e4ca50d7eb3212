"""Mixture-of-experts families whose experts are not transformers' fused kernels, trained under TP
exactly like one process.

Llama 4 text: its experts' forward takes the hidden states alone, the router's sigmoid scores
already multiplied into every expert's copy of the rows (``model.experts.routing_folded``); the
probe (``infer/experts.py``) calls it so and finds the split its fused ``gate_up_proj [E, H, 2I]``
(gate and up concatenated: 2 parts) and ``down_proj [E, I, H]`` take along the intermediate dim;
its shared expert is a dense MLP split column/row, its router (a linear layer with its own
forward) whole on every rank. The tiny model keeps the published defaults, sizes shrunk: chunked
attention on the RoPE layers with ``attention_chunk_size`` below the sequence length (so chunks
bite), the NoPE layer's temperature tuning at a ``floor_scale`` the positions reach, and MoE on
every other layer as Llama 4 Maverick publishes (``interleave_moe_layer_step=2``: dense MLPs of
``intermediate_size_mlp`` between them).

DBRX: its experts stacked ``[E * I, H]`` in a submodule, each stack split on its own and the width
its forward views them by made local (``infer/expert_blocks.py``). Hunyuan-MoE: fused experts
beside a shared MLP (its default config's single expert found too; trained with 4). Inkling: its
shared experts every expert on every token, its input embedding normed (``hf.lookup_norm``: the
vocabulary-parallel rows summed over TP before the norm, which runs whole on every rank). Doge-MoE's experts
(embedding rows) and LongCat-Flash's (zero-computation experts) are kept whole, the reason naming the model's
property: Doge-MoE trains here (its shared MLP split), LongCat-Flash in the matrix.

Reference: the plain transformers loop of ``helpers.plain_reference`` (one process, fp32), 5
steps; tolerances of the issue: loss 1e-5 and grad_norm 1e-4 relative. One 2-rank world (tp=2)
and one 4-rank world (tp=2 x fsdp=2) train every family here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from families import MOE_TINY as FAMILIES
from families import write_tiny_config
from helpers import assert_parity, plain_reference, run_ranks, shardlm_losses

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_families")
    return {t: write_tiny_config(str(root / t), t, FAMILIES[t], round_trip=True) for t in FAMILIES}


def _meta(path: str):
    from shardlm.parallel.model.meta import build_meta_model

    return build_meta_model(path)


def test_llama4_text_experts_split_along_the_intermediate_dim(dirs):
    """The probe calls Llama 4's experts with the routing folded in: gate_up_proj split on its
    last dim in 2 parts (gate, up), down_proj on its intermediate dim; the shared expert and the
    dense layers' MLPs column/row, the router whole."""
    from shardlm.parallel.infer.autotp import infer_plan

    plan = infer_plan(_meta(dirs["llama4_text"]), 2)
    layers = "model.layers"
    assert set(plan.experts) == {f"{layers}.{i}.feed_forward.experts" for i in (1, 3)}
    for entry in plan.experts.values():
        assert {n: (p.dim, p.parts, p.once) for n, p in entry.items()} == {
            "gate_up_proj": (2, 2, False),
            "down_proj": (1, 1, False),
        }
    for i, mlp in ((0, "feed_forward"), (1, "feed_forward.shared_expert")):
        for name, style in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise")):
            assert plan.styles[f"{layers}.{i}.{mlp}.{name}"] == style, (i, name)
    assert "router" in plan.replicated[f"{layers}.1.feed_forward.router"]
    assert set(plan.replicated) == {f"{layers}.{i}.feed_forward.router" for i in (1, 3)}


def test_llama4_text_refuses_expert_parallelism_in_one_line(dirs, tmp_path):
    """Its experts run on every token (no top-k dispatch): parallel.ep is refused before spawning."""
    from helpers import load_checked

    from shardlm import ConfigError

    (tmp_path / "data.txt").write_text("hello world\n")
    raw = {"model": dirs["llama4_text"], "data": {"path": str(tmp_path / "data.txt")}}
    with pytest.raises(ConfigError, match=r"parallel.ep=2: .* runs every expert on every token") as info:
        load_checked(raw={**raw, "parallel": {"fsdp": 2, "ep": 2}})
    assert "\n" not in str(info.value)


@pytest.mark.ranks
def test_tp2_matches_one_process(dirs):
    paths = [dirs[t] for t in FAMILIES]
    losses = run_ranks(shardlm_losses, 2, paths, {"tp": 2}, 4, 1)
    for model_type in FAMILIES:
        ref = plain_reference(dirs[model_type], 4)
        assert_parity(losses[dirs[model_type]], ref, label=f"{model_type} tp2")
        _report(f"{model_type} tp=2", losses[dirs[model_type]], ref)


# Doge-MoE's router pairs the logits of the batch's first half of tokens with its second half's
# (``router_logits.view(2, bsz * seq_len, -1)``): a data-parallel rank's routing is not one process's (measured:
# loss of 4 rows whole vs two halves averaged, 3e-4 relative; the dense model 9e-8), whatever TP does
BATCH_ROUTED = {"doge"}


@pytest.mark.ranks
def test_tp2_fsdp2_matches_one_process(dirs):
    types = [t for t in FAMILIES if t not in BATCH_ROUTED]
    paths = [dirs[t] for t in types]
    losses = run_ranks(shardlm_losses, 4, paths, {"tp": 2, "fsdp": 2}, 2, 1)
    for model_type in types:
        ref = plain_reference(dirs[model_type], 4)
        assert_parity(losses[dirs[model_type]], ref, label=f"{model_type} tp2xfsdp2")
        _report(f"{model_type} tp=2 x fsdp=2", losses[dirs[model_type]], ref)


def _report(label: str, got: list, ref: list) -> None:
    """Print the largest relative differences (``pytest -s`` shows them: the measured parity)."""
    loss = max(abs(a - b) / abs(b) for (a, _), (b, _) in zip(got, ref))
    norm = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, ref))
    print(f"{label}: loss {loss:.1e}, grad_norm {norm:.1e} relative, {len(ref)} steps")


def test_unsplit_experts_are_kept_whole_for_what_they_are(tmp_path):
    """Where no probe splits a mixture-of-experts layer, its experts are kept whole on every rank, the reason
    naming the model's property: Doge's experts are embedding rows (one neuron each; its shared MLP split);
    LongCat-Flash's zero-computation experts pass tokens through inside the experts' sum. Doge's published
    default is dense (``is_moe`` false): split."""
    from shardlm.parallel.infer.autotp import infer_plan

    paths = {}
    for name, model_type, overrides in (
        ("doge_moe", "doge", {"is_moe": True}),
        ("doge", "doge", {}),
        ("longcat_flash", "longcat_flash", {}),
    ):
        config = tiny_config(model_type)
        for key, value in overrides.items():
            setattr(config, key, value)
        config.save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)
    for name, whole, words in (
        ("doge_moe", "model.layers.0.mlp.up_embed", "whose experts are rows of embeddings (down_embed, up_embed)"),
        ("longcat_flash", "model.layers.0.mlp.experts", "whose zero-computation experts (gate_up_proj 260"),
    ):
        plan = infer_plan(_meta(paths[name]), 2)
        assert words in plan.replicated[whole] and "\n" not in plan.replicated[whole], (name, plan.replicated)
        assert plan.styles[whole] == "replicate_local", (name, plan.styles[whole])
    assert plan.styles["model.layers.0.mlps.0.down_proj"] == "rowwise"
    for name in ("doge", "doge_moe"):
        plan = infer_plan(_meta(paths[name]), 2)
        assert plan.styles["model.layers.0.mlp.down_proj"] == "rowwise"


def test_inkling_shared_experts_split_sums_to_the_whole(tmp_path):
    """Inkling's shared experts run every expert on every token, scaled by the router's gammas
    (``forward(hidden_states, gammas)``): the probe calls them so and splits each expert's intermediate
    dim; on real numbers (a CPU model, not meta) the two ranks' pieces sum to the whole module's output."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardlm.parallel.infer.expert_split import local_positions
    from shardlm.parallel.infer.experts import find_experts

    config = tiny_config("inkling_text")
    config.save_pretrained(tmp_path / "inkling")
    fqn = next(f for f in find_experts(_meta(str(tmp_path / "inkling")), 2) if f.endswith("shared_experts"))
    layout = find_experts(_meta(str(tmp_path / "inkling")), 2)[fqn]
    assert {n: (p.dim, p.parts) for n, p in layout.items()} == {
        "gate_proj": (1, 1),
        "up_proj": (1, 1),
        "down_proj": (2, 1),
    }
    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(config).float().get_submodule(fqn)
    whole = {n: torch.randn_like(p) * p.shape[-1] ** -0.5 for n, p in module.named_parameters()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, config.hidden_size, generator=g)
    gammas = torch.rand(7, whole["gate_proj"].shape[0], generator=g)

    def run(params):
        for name, value in params.items():
            module._parameters[name] = torch.nn.Parameter(value)
        return module(x, gammas)

    want = run(whole)
    total = sum(
        run(
            {
                n: v.index_select(layout[n].dim, local_positions(v.shape[layout[n].dim], 1, 2, r))
                for n, v in whole.items()
            }
        )
        for r in range(2)
    )
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_normed_embedding_is_found_by_its_norm():
    """Inkling's embedding normalizes its lookup in its own forward: ``lookup_norm`` names the norm (where the
    vocabulary-parallel style sums the ranks' rows); a plain embedding, or one whose forward is nn.Embedding's
    with a submodule beside, has none."""
    import torch.nn as nn
    from transformers.models.inkling.modeling_inkling import InklingNormedEmbedding

    from shardlm.parallel.model.hf import lookup_norm

    assert lookup_norm(InklingNormedEmbedding(16, 8, 0, 1e-6)) == "embed_norm"
    assert lookup_norm(nn.Embedding(16, 8)) is None
    beside = nn.Embedding(16, 8)
    beside.norm = nn.LayerNorm(8)
    assert lookup_norm(beside) is None
