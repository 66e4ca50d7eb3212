"""Pipeline parallelism (``parallel.pp``): stages cut from the model's own modules reproduce one process.

The reference is the plain transformers + torch loop of ``helpers.plain_reference`` (fp32, 5 steps,
global batch 4, clipping binding, padded and wholly-ignored samples): the loss to 1e-5 and the
gradient norm to 1e-4, relative, at every step. The refusals are checked before spawning, one line each.
"""

import json

import pytest
import torch
from families import write_tiny_config, write_tiny_dir
from helpers import assert_parity, load_checked, run_ranks, shardlm_losses, write_model_dir
from transformers import MixtralConfig

from shardlm import ConfigError
from shardlm.parallel.infer.stages import stage_layout
from shardlm.parallel.model.meta import build_meta_model
from shardlm.parallel.plan.stages import balance
from shardlm.parallel.runtime.pipeline import keep_stage

GLOBAL_BATCH = 4
# the router's load-balancing loss under pp: what it needs, and why the schedule cannot give it
ROUTER_REFUSAL = (
    r"load-balancing loss .* with parallel.pp=2 needs the step's whole expert counts before 1F1B's first backward"
)
LLAMA = {"num_hidden_layers": 4}  # untied embeddings (Llama's default): two blocks a stage at pp=2
# name -> (layout, per-device batch, accumulation): the global batch is always 4
LAYOUTS = {
    "pp2_1f1b": ({"pp": 2}, 2, 2),  # 2 micro-batches (pp) of 2 rows: the accumulation's batches joined
    "pp2_gpipe": ({"pp": 2, "pp_schedule": "GPipe", "pp_microbatches": 4}, 4, 1),
    "pp2_fsdp2": ({"pp": 2, "fsdp": 2}, 1, 2),
    "fsdp2": ({"fsdp": 2}, 1, 2),
    "pp4": ({"pp": 4}, 4, 1),
    "one": ({}, 2, 2),
}


def test_balance_weighs_embedding_and_head():
    """Blocks of 10 each, an embedding of 25 on the first stage and a head of 5 on the last: the
    smallest largest stage is 45 (embedding + 2 blocks | 4 blocks + head); equal blocks without
    extras cut evenly."""
    split = balance([10] * 6, 25, 5, 2)
    assert split.blocks == (range(0, 2), range(2, 6)) and split.params == (45, 45)
    assert balance([10] * 4, 0, 0, 4).blocks == tuple(range(i, i + 1) for i in range(4))


def test_stage_keeps_whole_model_names(tmp_path):
    """Each stage holds its blocks, the embedding on the first, the final norm and head on the
    last, every parameter under its name in the whole model, and together they hold every one once."""
    path = write_model_dir(str(tmp_path / "llama"), "llama", **LLAMA)
    whole = dict(build_meta_model(path).named_parameters())
    names = []
    for stage in range(2):
        model = build_meta_model(path)
        keep_stage(model, stage_layout(model, 2), stage)
        names.append(set(dict(model.named_parameters())))
    assert all(name in whole for part in names for name in part)
    assert names[0] & names[1] == set() and names[0] | names[1] == set(whole)
    assert "model.embed_tokens.weight" in names[0] and "model.layers.1.mlp.up_proj.weight" in names[0]
    assert (
        "lm_head.weight" in names[1]
        and "model.norm.weight" in names[1]
        and "model.layers.2.mlp.up_proj.weight" in names[1]
    )


def test_refusals_before_spawning(tmp_path):
    """One line each, naming the key: a schedule not supported yet, fewer micro-batches than
    1F1B's stages, micro-batches not dividing the batch, combinations not supported yet, more stages
    than blocks, the router's load-balancing loss, a multimodal checkpoint's language model one level down, a
    second stream carried from block to block (Inkling 2's block states)."""
    (tmp_path / "d.txt").write_text("a b c\n")
    llama = write_model_dir(str(tmp_path / "llama"), "llama", **LLAMA)
    router = str(tmp_path / "mixtral")
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    MixtralConfig(**sizes, num_hidden_layers=2, num_local_experts=4, output_router_logits=True).save_pretrained(router)
    nested = write_tiny_dir(str(tmp_path / "gemma3_mm"), "gemma3")  # the blocks under model.language_model
    config = json.loads((tmp_path / "gemma3_mm" / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = False
    (tmp_path / "gemma3_mm" / "config.json").write_text(json.dumps(config))
    train = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    streams = write_tiny_config(str(tmp_path / "inkling2"), "inkling2_text")  # block states, block to block
    cases = [
        (streams, {"pp": 2}, {}, r"Inkling2ForCausalLM's decoder block 1 is handed argument 1, computed before it"),
        (nested, {"pp": 2}, {}, r"decoder blocks \(model.language_model.layers\) are not a child of its base model"),
        (llama, {"pp": 2, "pp_schedule": "nope"}, {}, "parallel.pp_schedule 'nope'"),
        (llama, {"pp": 4, "pp_microbatches": 2}, {}, "parallel.pp_microbatches=2 is fewer than the 4 stages"),
        (llama, {"pp": 2, "pp_microbatches": 3}, {}, "parallel.pp_microbatches=3 must divide"),
        (llama, {"pp": 8, "pp_microbatches": 8}, {"per_device_train_batch_size": 8}, "model has 4 decoder blocks"),
        (router, {"pp": 2}, {"gradient_accumulation_steps": 1}, ROUTER_REFUSAL),
    ]
    for model, parallel, extra, match in cases:
        raw = {"model": model, "data": {"path": str(tmp_path / "d.txt")}, "parallel": parallel}
        raw["train"] = {"output_dir": str(tmp_path / "out"), **train, **extra}
        with pytest.raises(ConfigError, match=match) as info:
            load_checked(raw=raw)
        assert "\n" not in str(info.value), info.value
    assert load_checked(raw={**raw, "model": llama, "parallel": {"pp": 2}}).parallel.world_size == 2


@pytest.fixture(scope="module")
def models(pp_llama, pp_families):
    """Llama, Qwen3 with sliding blocks on the second stage and Gemma 3 (conftest's, shared with the other
    pipeline tests), each with its one-process reference."""
    return {"llama": pp_llama, **{name: pp_families[name] for name in ("qwen3_sliding", "gemma3")}}


@pytest.fixture(scope="module")
def llama(models):
    return models["llama"]


def jobs_losses(jobs: list[tuple[str, str]]) -> list:
    """Rank body: ``(model path, layout)`` runs one after another in one world; (loss, grad_norm) per step."""
    return [shardlm_losses([path], *LAYOUTS[layout])[path] for path, layout in jobs]


# the runs of each world, once for the module: (model, layout) -> ((loss, grad_norm) per step, eval before and after)
PP2_RUNS = [("llama", "pp2_1f1b"), ("llama", "pp2_gpipe"), ("qwen3_sliding", "pp2_1f1b"), ("gemma3", "pp2_1f1b")]
FOUR_RANK_RUNS = [("llama", "pp2_fsdp2"), ("llama", "pp4")]


def runs_in_one_world(models: dict, runs: list[tuple[str, str]], world: int, layouts: dict = LAYOUTS) -> dict:
    """Every ``(model name, layout)`` of ``runs`` in one ``world``-rank world, each trained and evaluated
    (``eval_runs``): ``{run: (losses, eval losses)}``."""
    jobs = [(models[name][0], *layouts[layout]) for name, layout in runs]
    return dict(zip(runs, run_ranks(eval_runs, world, jobs), strict=True))


@pytest.fixture(scope="module")
def pp2_runs(models):
    return runs_in_one_world(models, PP2_RUNS, 2)


@pytest.fixture(scope="module")
def four_rank_runs(models):
    return runs_in_one_world(models, FOUR_RANK_RUNS, 4)


@pytest.mark.ranks
def test_pp2_matches_one_process(models, pp2_runs):
    """pp=2: Llama under 1F1B (2 micro-batches) and GPipe (4); Qwen3 with sliding blocks on the second
    stage and Gemma 3 under 1F1B: loss and grad_norm of every step."""
    for (name, layout), (losses, _) in pp2_runs.items():
        assert_parity(losses, models[name][1], label=f"{name} {layout}")


@pytest.mark.ranks
def test_four_ranks_match_one_process(llama, four_rank_runs):
    """pp=2 x fsdp=2 (FSDP2 inside each stage, the norm summed over both) and pp=4 (one block a stage,
    4 micro-batches under 1F1B), 4 ranks each."""
    for (_, layout), (losses, _) in four_rank_runs.items():
        assert_parity(losses, llama[1], label=layout)


def train_and_save(path: str, layout: str, output_dir: str, resume: str | bool = False) -> list[float]:
    """Rank body: 10 steps of ``LAYOUTS[layout]`` saving at 5 and 10 (or the steps after ``resume``); the losses."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(path, shape, per_device, accum, 10, output_dir=output_dir, save_steps=5, resume=resume)
    mesh = build_mesh(cfg.parallel)
    return [h["loss"] for h in Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh).train()]


def resume_jobs(path: str, root: str) -> dict:
    """Rank body (2 ranks): pp=2 and fsdp=2 runs of 10 steps, then each one's step-5 resumed on the other layout."""
    out = {name: train_and_save(path, name, f"{root}/{name}") for name in ("pp2_1f1b", "fsdp2")}
    for name, other in (("pp2_1f1b", "fsdp2"), ("fsdp2", "pp2_1f1b")):
        step5 = f"{root}/{other}/checkpoints/step-5"
        out[f"{name} from {other}"] = train_and_save(path, name, f"{root}/{name}-from-{other}", resume=step5)
    return out


@pytest.mark.ranks
def test_checkpoint_resumes_across_pp_and_fsdp(llama, tmp_path):
    """Each stage saves its part of one DCP checkpoint under the whole model's names: a pp=2 checkpoint
    resumes at fsdp=2 and an fsdp=2 one at pp=2, steps 6-10 as the uninterrupted runs' (1e-5)."""
    path, _ = llama
    got = run_ranks(resume_jobs, 2, path, str(tmp_path))
    for name, other in (("pp2_1f1b", "fsdp2"), ("fsdp2", "pp2_1f1b")):
        resumed, full = got[f"{name} from {other}"], got[name][5:]
        assert len(resumed) == 5, resumed
        for step, (a, b) in enumerate(zip(resumed, full), start=6):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} from {other} step {step}: {a} vs {b}"
    # consolidation is unchanged: the pp=2 run's step-10 holds every tensor of the model, as the fsdp=2 run's
    from safetensors.torch import load_file

    from shardlm.checkpoint import export

    weights = []
    for run in ("pp2_1f1b", "fsdp2"):
        export.consolidate(str(tmp_path / run), str(tmp_path / f"hf-{run}"))
        weights.append(load_file(str(tmp_path / f"hf-{run}" / "model.safetensors")))
    assert weights[0].keys() == weights[1].keys() and "lm_head.weight" in weights[0]
    for key, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def eval_run(path: str, shape: dict, per_device: int, accum: int) -> tuple[list, list]:
    """Rank body: a layout (``LAYOUTS``' shape, rows per device, accumulation) trained 5 steps, evaluated before
    and after (13 eval samples: the last batch is short, and at fsdp=2 a rank past the end runs an all-ignored
    one): (loss, grad_norm) per step and (eval loss, eval tokens) before and after."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    cfg = train_config(path, shape, per_device, accum, 5)
    mesh = build_mesh(cfg.parallel)
    trainer = Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh, eval_dataset=token_dataset(13, seed=5))
    before = trainer.evaluate()
    steps = [(h["loss"], h["grad_norm"]) for h in trainer.train()]
    return steps, [(r["eval_loss"], r["eval_tokens"]) for r in [before, *trainer.eval_history]]


def eval_runs(jobs: list[tuple[str, dict, int, int]]) -> list[tuple[list, list]]:
    """Rank body: ``eval_run`` of each ``(path, shape, per-device rows, accumulation)`` in turn in one world."""
    return [eval_run(*job) for job in jobs]


@pytest.mark.ranks
def test_eval_through_the_stages(llama, pp2_runs, four_rank_runs):
    """Evaluation sends each batch through the stages in turn: pp=2 and pp=2 x fsdp=2's eval loss (before
    and after training) equal one process's (1e-5), over the same labelled-token count."""
    path, _ = llama
    _, one = run_ranks(eval_run, 1, path, *LAYOUTS["one"])
    assert len(one) == 2 and one[0][0] != one[1][0]
    for layout, (_, got) in (
        ("pp2_1f1b", pp2_runs[("llama", "pp2_1f1b")]),
        ("pp2_fsdp2", four_rank_runs[("llama", "pp2_fsdp2")]),
    ):
        for (loss, tokens), (ref, ref_tokens) in zip(got, one, strict=True):
            assert tokens == ref_tokens and abs(loss - ref) <= 1e-5 * ref, (layout, got, one)


def run_losses(path: str, layout: str, train: dict) -> list:
    """Rank body: ``layout`` with the ``train`` settings given; (loss, grad_norm) per step."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(path, shape, per_device, accum, 5, **train)
    mesh = build_mesh(cfg.parallel)
    return [(h["loss"], h["grad_norm"]) for h in Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh).train()]


@pytest.mark.ranks
def test_activation_checkpointing_on_stages(llama):
    """pp=2 with every block of each stage recomputed in the backward: the one-process reference's numbers."""
    path, ref = llama
    got = run_ranks(run_losses, 2, path, "pp2_1f1b", {"gradient_checkpointing": True})
    assert_parity(got, ref, label="pp2 checkpointed")


@pytest.mark.ranks
def test_bf16_autocast_on_stages(llama):
    """train.bf16 without FSDP: each stage's forward runs under autocast as the trainer's own does (else
    the stages would train in fp32 silently); pp=2 against one process, both in bf16."""
    path, _ = llama
    one = run_ranks(run_losses, 1, path, "one", {"bf16": True})
    got = run_ranks(run_losses, 2, path, "pp2_1f1b", {"bf16": True})
    assert_parity(got, one, label="pp2 bf16")


def packed_losses(path: str, layout: str) -> list:
    """Rank body: the data as ``bfd`` packing makes it, position ids restarting at each document (every
    sample two or three documents), trained at ``layout``; (loss, grad_norm) per step."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    data = token_dataset()
    g = torch.Generator().manual_seed(3)
    positions = []
    for _ in range(len(data)):
        cuts = sorted(torch.randint(2, data.input_ids.shape[1] - 2, (2,), generator=g).tolist())
        lengths = [cuts[0], cuts[1] - cuts[0], data.input_ids.shape[1] - cuts[1]]
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
    data.position_ids = torch.stack(positions)
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(path, shape, per_device, accum, 5)
    mesh = build_mesh(cfg.parallel)
    return [(h["loss"], h["grad_norm"]) for h in Trainer(parallelize(path, mesh), cfg, data, mesh).train()]


@pytest.mark.ranks
def test_packed_documents_reach_every_stage(llama):
    """Packed documents: the position ids (and so the block-diagonal mask the model builds from them)
    reach the second stage; pp=2 equals one process on the same packed data, which differs from the
    unpacked reference (the documents are really kept apart)."""
    path, unpacked = llama
    one = run_ranks(packed_losses, 1, path, "one")
    assert abs(one[0][0] - unpacked[0][0]) > 1e-3 * unpacked[0][0]
    assert_parity(run_ranks(packed_losses, 2, path, "pp2_1f1b"), one, label="packed pp2")
