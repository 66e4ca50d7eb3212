"""Pipeline parity for every family issue #29 names at the layouts it names, where the other pipeline tests do
not already run them (the grid, with where each cell is tested, is docs/pipeline.md's "Families and layouts").

Qwen3 (sliding-window blocks on the second stage), Gemma 3 (sliding and full blocks) and GPT-2 (learned
positions, tied embeddings) under two stages a rank (Interleaved1F1B, ZBVZeroBubble) at pp=2, and at pp=4
(1F1B, one block a stage), pp=2 x fsdp=2 and pp=2 x tp=2 (4 ranks); Qwen3-MoE with 4 sparse blocks under
both schedules of two stages a rank, at pp=4 and pp=2 x tp=2, and at pp=2 x fsdp=2 x ep=2 with two stages a
rank under Interleaved1F1B (its expert parallelism with one stage a rank is test_pipeline_moe's); LoRA on every
projection of Llama at pp=4 and pp=2 x fsdp=2 against one-process peft.
Every family's one-process reference is conftest's, computed once; the runs of each world size are jobs of
one ``run_ranks`` call on the pooled ranks.

The reference is the plain transformers + torch loop of ``helpers.plain_reference`` (fp32, 5 steps, global
batch 4, clipping binding, padded and wholly-ignored samples): the loss to 1e-5 and the gradient norm to
1e-4, relative, at every step.
"""

import sys
from pathlib import Path

import pytest
from helpers import assert_parity, plain_reference, run_ranks, shardlm_losses
from test_pipeline import runs_in_one_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import tiny_config  # noqa: E402

GLOBAL_BATCH = 4
# name -> (layout, per-device batch, accumulation): the global batch is always 4
LAYOUTS = {
    "pp2_interleaved": ({"pp": 2, "pp_schedule": "Interleaved1F1B"}, 2, 2),  # 4 stages: rank 0 holds 0 and 2
    "pp2_zbv": ({"pp": 2, "pp_schedule": "ZBVZeroBubble"}, 2, 2),  # 4 stages in a V: rank 0 holds 0 and 3
    "pp4": ({"pp": 4}, 4, 1),  # 1F1B, one block a stage, 4 micro-batches
    "pp2_fsdp2": ({"pp": 2, "fsdp": 2}, 1, 2),
    "pp2_tp2": ({"pp": 2, "tp": 2}, 2, 2),
    # 8 stages, two a rank, one block each: benchmarks/pp_families.py's, on 8-block models
    "pp4_interleaved": ({"pp": 4, "pp_schedule": "Interleaved1F1B"}, 4, 1),
    "pp4_zbv": ({"pp": 4, "pp_schedule": "ZBVZeroBubble"}, 4, 1),
    # 4 stages, two a rank, each stage's two data-parallel ranks holding 2 of its block's 4 experts
    "pp2_fsdp2_ep2_interleaved": ({"pp": 2, "fsdp": 2, "ep": 2, "pp_schedule": "Interleaved1F1B"}, 2, 1),
}
TWO_RANK_RUNS = [
    ("qwen3_sliding", "pp2_interleaved"),
    ("qwen3_sliding", "pp2_zbv"),
    ("gemma3", "pp2_interleaved"),
    ("gemma3", "pp2_zbv"),
    ("gpt2", "pp2_zbv"),  # the V holds the embedding's and the head's stages on rank 0: one tied parameter there
    ("qwen3_moe", "pp2_interleaved"),
    ("qwen3_moe", "pp2_zbv"),
]
FOUR_RANK_RUNS = [
    *((name, layout) for name in ("qwen3_sliding", "gemma3", "gpt2") for layout in ("pp4", "pp2_fsdp2", "pp2_tp2")),
    ("qwen3_moe", "pp4"),
    ("qwen3_moe", "pp2_tp2"),
    ("qwen3_moe", "pp2_fsdp2_ep2_interleaved"),
]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RUNS = ["pp4", "pp2_fsdp2"]


@pytest.fixture(scope="module")
def models(pp_llama, pp_families, tmp_path_factory):
    """conftest's Llama, Qwen3, Gemma 3 and GPT-2, and Qwen3-MoE as ``scripts/tiny.py`` shrinks it (4 experts,
    top-2) with 4 sparse blocks (one a stage at pp=4 and under two stages a rank), with its reference."""
    path = str(tmp_path_factory.mktemp("pp_families") / "qwen3_moe")
    config = tiny_config("qwen3_moe")
    config.num_hidden_layers = 4
    assert not config.output_router_logits and not config.mlp_only_layers
    config.save_pretrained(path)
    return {"llama": pp_llama, **pp_families, "qwen3_moe": (path, plain_reference(path, GLOBAL_BATCH))}


def check(losses: list, ref: list, label: str) -> None:
    """``assert_parity``, the largest differences printed first (docs/pipeline.md's grid quotes them)."""
    dloss = max(abs(a - b) for (a, _), (b, _) in zip(losses, ref))
    dnorm = max(abs(a - b) / b for (_, a), (_, b) in zip(losses, ref))
    print(f"{label}: max |dloss| {dloss:.1e}, max grad_norm {dnorm:.1e} relative, {len(ref)} steps")
    assert_parity(losses, ref, label=label)


@pytest.mark.ranks
def test_families_with_two_stages_a_rank(models):
    """pp=2 with two stages a rank (one block each): Qwen3 and Gemma 3 (each stage's ``layer_types`` its own
    block's, the sliding masks built on every stage), GPT-2 under ZBVZeroBubble (the first and last stage on rank
    0 sharing the tied weight, the learned positions on the first), Qwen3-MoE (a router and its experts whole on
    each stage) under Interleaved1F1B and ZBVZeroBubble (split backward): one process's loss and grad_norm."""
    for (name, layout), (losses, _) in runs_in_one_world(models, TWO_RANK_RUNS, 2, LAYOUTS).items():
        check(losses, models[name][1], f"{name} {layout}")


@pytest.mark.ranks
def test_families_on_four_ranks(models):
    """pp=4 (1F1B, one block a stage), pp=2 x fsdp=2 (each stage its FSDP root; GPT-2's tied copies' shards
    summed between the stages) and pp=2 x tp=2 (each stage's narrowed plan, the vocabulary-parallel loss on the
    last) for Qwen3, Gemma 3 and GPT-2; Qwen3-MoE at pp=4, pp=2 x tp=2 and, with two stages a rank, pp=2 x
    fsdp=2 x ep=2 under Interleaved1F1B (each stage's all-to-alls within its own two ranks, stage after stage):
    one process's loss and grad_norm."""
    for (name, layout), (losses, _) in runs_in_one_world(models, FOUR_RANK_RUNS, 4, LAYOUTS).items():
        check(losses, models[name][1], f"{name} {layout}")


def lora_runs(path: str, adapter: str, layouts: list[str]) -> list:
    """Rank body: LoRA training of ``path`` from ``adapter`` at each of ``layouts`` in turn; (loss, grad_norm)
    per step."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize
    from shardlm.config import LoraConfig

    init_distributed()
    out = []
    for layout in layouts:
        cfg = train_config(path, *LAYOUTS[layout], 5)
        cfg.lora = LoraConfig(adapter=adapter)
        mesh = build_mesh(cfg.parallel)
        model = parallelize(path, mesh, seed=0, lora_config=cfg.lora)
        out.append([(h["loss"], h["grad_norm"]) for h in Trainer(model, cfg, token_dataset(), mesh).train()])
    return out


@pytest.mark.ranks
def test_lora_at_pp4_and_with_fsdp(models, tmp_path):
    """LoRA on every projection of Llama (random lora_B: every gradient path live from step 1) at pp=4 (four
    stages each holding its block's adapters) and pp=2 x fsdp=2 (the adapters sharded with their stage, the
    frozen base too): one-process peft's loss and grad_norm."""
    from helpers import make_adapter
    from test_lora import peft_reference

    path, _ = models["llama"]
    adapter = make_adapter(path, str(tmp_path / "adapter"), LORA_TARGETS)
    ref, _, _ = peft_reference(path, adapter)
    for layout, losses in zip(LORA_RUNS, run_ranks(lora_runs, 4, path, adapter, LORA_RUNS), strict=True):
        check(losses, ref, f"lora {layout}")


@pytest.mark.ranks
def test_hybrid_layers_in_stages(tmp_path):
    """OLMo-hybrid's layers of two kinds (Gated DeltaNet and full attention, ``model.decoder_blocks`` by its own
    ``_no_split_modules``; it had no blocks, so pp was refused) cut into two stages under 1F1B: one process's loss
    and grad_norm."""
    from families import write_tiny_dir

    path = write_tiny_dir(str(tmp_path / "olmo_hybrid"), "olmo_hybrid")
    losses = run_ranks(shardlm_losses, 2, [path], {"pp": 2}, 2, 2)[path]
    check(losses, plain_reference(path, GLOBAL_BATCH), "olmo_hybrid pp2")
