"""Pipeline stages beyond one untied run of blocks a rank (``parallel.pp``, issue #29): tied embeddings
held by the first and the last stage; forwards that change the embeddings before the first block
(GPT-2's learned positions), which the first stage runs and a later stage replaces at its first block.

The reference is the plain transformers + torch loop of ``helpers.plain_reference`` (fp32, 5 steps,
global batch 4, clipping binding): the loss to 1e-5 and the gradient norm to 1e-4, relative, at every step.
"""

import pool
import pytest
import torch
from helpers import assert_parity, load_checked, plain_reference, run_ranks, shardlm_losses, write_model_dir
from test_pipeline import eval_run, runs_in_one_world

from shardlm import ConfigError
from shardlm.parallel.infer.stages import stage_layout
from shardlm.parallel.model.meta import build_meta_model
from shardlm.parallel.runtime.pipeline import Discarded, keep_stage

GLOBAL_BATCH = 4
GPT2_DROPOUT = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}  # GPT-2's published dropout
# name -> (layout, per-device batch, accumulation): the global batch is always 4
LAYOUTS = {
    "pp2": ({"pp": 2}, 2, 2),
    "pp2_fsdp2": ({"pp": 2, "fsdp": 2}, 1, 2),
    # two stages a rank (4 in all): stages 0 and 2 on rank 0 (loops) or 0 and 3 (a V)
    "pp2_interleaved": ({"pp": 2, "pp_schedule": "Interleaved1F1B"}, 2, 2),
    "pp2_interleaved_zb": ({"pp": 2, "pp_schedule": "InterleavedZeroBubble"}, 2, 2),
    "pp2_zbv": ({"pp": 2, "pp_schedule": "ZBVZeroBubble"}, 2, 2),
    "pp2_looped_bfs": ({"pp": 2, "pp_schedule": "LoopedBFS"}, 2, 2),
    "pp2_dualpipev": ({"pp": 2, "pp_schedule": "DualPipeV", "pp_microbatches": 4}, 2, 2),  # a micro-batch a stage
    "one": ({}, 2, 2),
}


@pytest.fixture(scope="module")
def models(pp_llama, pp_families, tmp_path_factory):
    """Llama (untied: conftest's, shared with the other pipeline tests, and tied), GPT-2 (learned positions,
    tied), Granite (its forward scales the embeddings by ``embedding_multiplier``) and GPT-2 with its
    published dropout 0.1, 4 blocks each, with their one-process references (the dropout masks drawn as
    shardlm keys them, by sample and call)."""
    root = tmp_path_factory.mktemp("pp_stages")
    tied = {"num_hidden_layers": 4, "tie_word_embeddings": True}
    paths = {
        "llama_tied": write_model_dir(str(root / "llama_tied"), "llama", **tied),
        "granite": write_model_dir(str(root / "granite"), "granite", num_hidden_layers=4),
        "gpt2_dropout": write_model_dir(str(root / "gpt2_dropout"), "gpt2", n_layer=4, **GPT2_DROPOUT),
    }
    drop = {name: name == "gpt2_dropout" for name in paths}
    refs = {name: (path, plain_reference(path, GLOBAL_BATCH, dropout=drop[name])) for name, path in paths.items()}
    return {"llama": pp_llama, "gpt2": pp_families["gpt2"], **refs}


def test_tied_weight_on_first_and_last_stage(models):
    """The first stage holds the embedding, the last the head and the embedding's module sharing its
    weight, under the same name on both; a middle stage neither."""
    path, _ = models["llama_tied"]
    held = []
    for stage in range(3):
        model = build_meta_model(path)
        layout = stage_layout(model, 3)
        assert layout.tied
        keep_stage(model, layout, stage)
        held.append(dict(model.named_parameters(remove_duplicate=False)))
    assert "model.embed_tokens.weight" in held[0] and "lm_head.weight" not in held[0]
    assert not {"model.embed_tokens.weight", "lm_head.weight"} & set(held[1])
    assert held[2]["model.embed_tokens.weight"] is held[2]["lm_head.weight"]


def jobs_losses(jobs: list[tuple[str, str]]) -> list:
    """Rank body: ``(model path, layout)`` runs one after another in one world; (loss, grad_norm) per step."""
    return [shardlm_losses([path], *LAYOUTS[layout])[path] for path, layout in jobs]


@pytest.mark.ranks
def test_tied_embeddings_match_one_process(models):
    """pp=2 with tied embeddings: the two copies' gradients summed between the first and last stage,
    the weight counted once in the norm; GPT-2 also adds its learned position embedding before the
    first block (on the first stage; the second replaces what its stand-in gives at its first block),
    Granite scales them in its forward (the second stage must not scale again); loss and grad_norm of
    every step as one process's."""
    names = ["llama_tied", "gpt2", "granite"]
    got = run_ranks(jobs_losses, 2, [(models[name][0], "pp2") for name in names])
    for name, losses in zip(names, got):
        assert_parity(losses, models[name][1], label=f"{name} pp2")


def test_position_embedding_stays_on_the_first_stage(models):
    """GPT-2's ``wpe`` runs before the first block: the first stage holds it, a later stage a stand-in
    without parameters giving zeros of its output's shape (replaced at the first block)."""
    path, _ = models["gpt2"]
    model = build_meta_model(path)
    layout = stage_layout(model, 2)
    assert layout.before == ("transformer.wpe",) and layout.restarts and layout.tied
    keep_stage(model, layout, 1)
    assert not any(name.startswith("transformer.wpe.") for name, _ in model.named_parameters())
    stand_in = model.get_submodule("transformer.wpe")
    assert isinstance(stand_in, Discarded)
    out = stand_in(torch.arange(5)[None])
    assert out.shape == (1, 5, 32) and not out.any()
    granite = stage_layout(build_meta_model(models["granite"][0]), 2)
    assert granite.restarts and granite.before == () and not granite.tied


@pytest.mark.ranks
def test_tied_embeddings_with_fsdp_in_stages(models):
    """pp=2 x fsdp=2 with tied embeddings: FSDP reduces each copy's gradient over its stage's ranks first,
    then the shards are summed between the stages (4 ranks)."""
    path, ref = models["llama_tied"]
    (got,) = run_ranks(jobs_losses, 4, [(path, "pp2_fsdp2")])
    assert_parity(got, ref, label="llama tied pp2 x fsdp2")


def train_and_save(path: str, layout: str, output_dir: str) -> list:
    """Rank body: 5 steps of ``LAYOUTS[layout]`` saving at 5; the stages' copies of the tied weight equal."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(path, shape, per_device, accum, 5, output_dir=output_dir, save_steps=5)
    mesh = build_mesh(cfg.parallel)
    model = parallelize(path, mesh)
    history = Trainer(model, cfg, token_dataset(), mesh).train()
    weight = dict(model.module.named_parameters()).get("model.embed_tokens.weight")
    return [h["loss"] for h in history], None if weight is None else weight.detach().clone()


@pytest.mark.ranks
def test_tied_checkpoint_consolidates_to_one_weight(models, tmp_path):
    """After 5 steps the first and last stage hold the same tied weight (bit for bit), and the pp=2
    checkpoint consolidates to one tied tensor (no ``lm_head.weight``, as ``save_pretrained`` writes)
    equal, with every other tensor, to the one-process run's."""
    from safetensors.torch import load_file

    from shardlm.checkpoint import export

    path, _ = models["llama_tied"]
    stages = pool.run(train_and_save, 2, path, "pp2", str(tmp_path / "pp2"))
    assert torch.equal(stages[0][1], stages[1][1])
    one = run_ranks(train_and_save, 1, path, "one", str(tmp_path / "one"))
    assert stages[0][0] == stages[1][0] and all(abs(a - b) <= 1e-5 * b for a, b in zip(stages[0][0], one[0]))
    weights = []
    for run in ("pp2", "one"):
        export.consolidate(str(tmp_path / run), str(tmp_path / f"hf-{run}"))
        weights.append(load_file(str(tmp_path / f"hf-{run}" / "model.safetensors")))
    assert "lm_head.weight" not in weights[0] and weights[0].keys() == weights[1].keys()
    for key, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][key], rtol=1e-5, atol=1e-6, msg=key)


VIRTUAL_RUNS = [
    ("llama", "pp2_interleaved"),
    ("llama", "pp2_interleaved_zb"),
    ("llama", "pp2_zbv"),
    ("llama", "pp2_looped_bfs"),
    ("llama", "pp2_dualpipev"),
    ("gpt2", "pp2_interleaved"),
    ("llama_tied", "pp2_zbv"),  # the V holds both copies' stages on rank 0: one parameter there
]


@pytest.fixture(scope="module")
def virtual_runs(models):
    return runs_in_one_world(models, VIRTUAL_RUNS, 2, LAYOUTS)


@pytest.mark.ranks
def test_virtual_stages_match_one_process(models, virtual_runs):
    """Two stages a rank at pp=2 (one block each): Interleaved1F1B and InterleavedZeroBubble (rank 0 holds
    stages 0 and 2) and ZBVZeroBubble (0 and 3, a V), whose backward is split into input and weight
    gradients; GPT-2 (tied across ranks 0 and 1, learned positions) under Interleaved1F1B; tied Llama under
    ZBVZeroBubble (the V puts the embedding's and the head's stages on rank 0, which holds one parameter for
    both). Loss and grad_norm of every step as one process's: the clipping sees whole gradients."""
    for (name, layout), (losses, _) in virtual_runs.items():
        assert_parity(losses, models[name][1], label=f"{name} {layout}")


def rank_stage_names(path: str, layout: str) -> tuple[list[int], list[str], int]:
    """Rank body: this rank's stage indices, the joined module's parameter names and the trainer's count."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(path, shape, per_device, accum, 1)
    mesh = build_mesh(cfg.parallel)
    model = parallelize(path, mesh)
    trainer = Trainer(model, cfg, token_dataset(), mesh)
    return [part.index for part in model.stage], sorted(dict(model.module.named_parameters())), trainer.num_params


@pytest.mark.ranks
def test_virtual_stages_are_slices_of_the_model(models):
    """Interleaved1F1B at pp=2: rank 0 holds stages 0 and 2 (blocks 0 and 2, the embedding), rank 1 stages 1
    and 3 (blocks 1 and 3, the norm and head); ZBVZeroBubble: rank 0 holds 0 and 3 (blocks 0 and 3, the
    embedding, norm and head). Each rank's joined module names its parameters as the whole model does,
    together every one once; the trainer counts the whole model."""
    path, _ = models["llama"]
    whole = dict(build_meta_model(path).named_parameters())
    for layout, expect in (("pp2_interleaved", ([0, 2], [1, 3])), ("pp2_zbv", ([0, 3], [1, 2]))):
        got = pool.run(rank_stage_names, 2, path, layout)
        assert (got[0][0], got[1][0]) == expect, layout
        names = [set(got[r][1]) for r in range(2)]
        assert not names[0] & names[1] and names[0] | names[1] == set(whole), layout
        blocks = [{n.split(".")[2] for n in part if n.startswith("model.layers.")} for part in names]
        assert blocks == [{str(i) for i in expect[0]}, {str(i) for i in expect[1]}], layout
        assert got[0][2] == got[1][2] == sum(p.numel() for p in whole.values()), layout


def test_virtual_stage_refusals(models, tmp_path):
    """One line each before spawning, naming the key: a multi-stage schedule with one stage a rank, virtual
    stages under a one-stage schedule, a V with other than 2, micro-batches that do not come in torch's
    rounds, more stages than blocks, DualPipeV with fewer micro-batches than stages (torch's rule) or other than
    2 stages a rank; Interleaved1F1B with FSDP, TP, LoRA and activation checkpointing loads."""
    (tmp_path / "d.txt").write_text("a b c\n")
    llama = models["llama"][0]
    zbv = {"pp": 2, "pp_schedule": "ZBVZeroBubble"}
    interleaved = {"pp": 2, "pp_schedule": "Interleaved1F1B"}
    cases = [
        (llama, {**interleaved, "pp_virtual_stages": 1}, {}, "runs several stages on each rank but parallel.pp_virt"),
        (llama, {"pp": 2, "pp_virtual_stages": 2}, {}, "parallel.pp_virtual_stages=2 needs a schedule"),
        (llama, {**zbv, "pp_virtual_stages": 3}, {}, "places exactly 2 stages on each rank"),
        (llama, {**interleaved, "pp_microbatches": 5}, {"per_device_train_batch_size": 5}, "in rounds of"),
        (llama, {**interleaved, "pp_virtual_stages": 4}, {}, "8 pipeline stages .* model has 4 decoder blocks"),
        (llama, {"pp": 2, "pp_schedule": "DualPipeV"}, {}, "parallel.pp_microbatches=2 is fewer than the 4 stages"),
        (llama, {"pp": 2, "pp_schedule": "DualPipeV", "pp_virtual_stages": 3}, {}, "places exactly 2 stages"),
    ]
    for model, parallel, extra, match in cases:
        raw = {"model": model, "data": {"path": str(tmp_path / "d.txt")}, "parallel": parallel}
        raw["train"] = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, **extra}
        with pytest.raises(ConfigError, match=match) as info:
            load_checked(raw=raw)
        assert "\n" not in str(info.value), info.value
    assert load_checked(raw={**raw, "model": llama, "parallel": interleaved}).parallel.pp_stages_per_rank == 2
    composed = {**interleaved, "fsdp": 2, "tp": 2}
    raw["train"] = {**raw["train"], "gradient_checkpointing": True}
    raw["lora"] = {"target_modules": ["q_proj"]}
    assert load_checked(raw={**raw, "model": llama, "parallel": composed}).parallel.world_size == 8


@pytest.mark.ranks
def test_eval_through_virtual_stages(models, virtual_runs):
    """Evaluation sends each batch through the four stages in stage order, under ZBVZeroBubble the last on
    rank 0 (which then broadcasts the loss sums): before and after training, one process's eval loss (1e-5)
    over the same labelled-token count."""
    path, _ = models["llama"]
    _, one = run_ranks(eval_run, 1, path, *LAYOUTS["one"])
    _, got = virtual_runs[("llama", "pp2_zbv")]
    assert len(one) == 2 and one[0][0] != one[1][0]
    for (loss, tokens), (ref, ref_tokens) in zip(got, one, strict=True):
        assert tokens == ref_tokens and abs(loss - ref) <= 1e-5 * ref, (got, one)


def resume_losses(path: str, layout: str, output_dir: str, steps: int, resume: str | bool = False) -> list:
    """Rank body: ``steps`` steps of ``LAYOUTS[layout]`` saving at 5 (or the steps after ``resume``); the losses."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(path, shape, per_device, accum, steps, output_dir=output_dir, save_steps=5, resume=resume)
    mesh = build_mesh(cfg.parallel)
    return [h["loss"] for h in Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh).train()]


@pytest.mark.ranks
def test_virtual_stage_checkpoint_resumes_in_one_process(models, tmp_path):
    """Under Interleaved1F1B each rank saves its two stages' part of one DCP checkpoint under the whole
    model's names: its step-5 checkpoint resumed in one process gives steps 6-10 of the uninterrupted
    interleaved run (1e-5)."""
    path, _ = models["llama"]
    full = run_ranks(resume_losses, 2, path, "pp2_interleaved", str(tmp_path / "pp2"), 10)
    step5 = str(tmp_path / "pp2" / "checkpoints" / "step-5")
    resumed = run_ranks(resume_losses, 1, path, "one", str(tmp_path / "one"), 10, step5)
    assert len(resumed) == 5, resumed
    for step, (a, b) in enumerate(zip(resumed, full[5:]), start=6):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"


def checkpointed_losses(path: str, layout: str) -> list:
    """Rank body: ``layout`` with every block recomputed in the backward; (loss, grad_norm) per step."""
    from helpers import token_dataset, train_config

    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    shape, per_device, accum = LAYOUTS[layout]
    cfg = train_config(path, shape, per_device, accum, 5, gradient_checkpointing=True)
    mesh = build_mesh(cfg.parallel)
    return [(h["loss"], h["grad_norm"]) for h in Trainer(parallelize(path, mesh), cfg, token_dataset(), mesh).train()]


@pytest.mark.ranks
def test_restarted_stage_recomputes_from_what_it_received(models):
    """GPT-2 at pp=2 with activation checkpointing: the second stage's first block, handed the hidden states
    it received by a module hook (outside transformers' checkpoint of the block's forward), recomputes
    from them in the backward."""
    path, ref = models["gpt2"]
    assert_parity(run_ranks(checkpointed_losses, 2, path, "pp2"), ref, label="gpt2 pp2 checkpointed")


@pytest.mark.ranks
def test_dropout_on_stages_matches_one_process(models):
    """GPT-2 with dropout 0.1 (embedding, attention probabilities, residuals) at pp=2 under 1F1B and
    Interleaved1F1B: each micro-batch's masks keyed by its samples' positions in the global batch, and a
    later stage's calls numbered from where one process's count is at its first block, so the masks are
    one process's (and differ from no dropout)."""
    path, ref = models["gpt2_dropout"]
    assert abs(ref[0][0] - models["gpt2"][1][0][0]) > 1e-3 * ref[0][0]  # the dropout really changes the loss
    runs = ["pp2", "pp2_interleaved"]
    for layout, losses in zip(runs, run_ranks(jobs_losses, 2, [(path, layout) for layout in runs])):
        assert_parity(losses, ref, label=f"gpt2 dropout {layout}")
