"""Pipeline parallelism composed (``parallel.pp`` with ``parallel.tp``): stages cut from the model's own
modules, the TP plan of the whole model applied inside each stage, reproduce one process.

The reference is the plain transformers + torch loop of ``helpers.plain_reference`` (fp32, 5 steps,
global batch 4, clipping binding, padded and wholly-ignored samples): the loss to 1e-5 and the
gradient norm to 1e-4, relative, at every step.
"""

import pytest
from helpers import assert_parity, plain_reference, run_ranks, shardlm_losses, write_model_dir

from shardlm.parallel.infer.autotp import infer_plan
from shardlm.parallel.infer.stages import stage_layout
from shardlm.parallel.model.meta import build_meta_model
from shardlm.parallel.runtime.pipeline import keep_stage, stage_plan

GLOBAL_BATCH = 4
LLAMA = {"num_hidden_layers": 4}  # untied embeddings: two blocks a stage at pp=2
# name -> (layout, per-device batch, accumulation): the global batch is always 4
LAYOUTS = {
    "pp2_tp2": ({"pp": 2, "tp": 2}, 2, 2),  # every tp rank of a stage reads the same 2 micro-batches of 2 rows
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_model_dir(str(tmp_path_factory.mktemp("ppc") / "llama"), "llama", **LLAMA)
    return path, plain_reference(path, GLOBAL_BATCH)


def test_stage_plan_holds_the_stage_modules(tmp_path):
    """The plan is inferred on the whole model; each stage's is narrowed to the modules it holds, so
    together the stages' styles are the whole plan's, each one placed once, under the same names."""
    path = write_model_dir(str(tmp_path / "llama"), "llama", **LLAMA)
    whole = infer_plan(build_meta_model(path), 2)
    styles = []
    for stage in range(2):
        model = build_meta_model(path)
        keep_stage(model, stage_layout(model, 2), stage)
        plan = stage_plan(whole, model)
        assert all(model.get_submodule(fqn) is not None for fqn in plan.styles)
        assert set(plan.attention) <= set(whole.attention) and plan.attention
        styles.append(plan.styles)
    assert styles[0].keys() & styles[1].keys() == set()
    assert {**styles[0], **styles[1]} == whole.styles
    assert "model.embed_tokens" in styles[0] and "lm_head" in styles[1]
    assert "model.layers.0.self_attn.q_proj" in styles[0] and "model.layers.3.mlp.down_proj" in styles[1]


def jobs_losses(jobs: list[tuple[str, str]]) -> list:
    """Rank body: ``(model path, layout)`` runs one after another in one world; (loss, grad_norm) per step."""
    return [shardlm_losses([path], *LAYOUTS[layout])[path] for path, layout in jobs]


@pytest.mark.ranks
def test_pp2_tp2_matches_one_process(llama):
    """pp=2 x tp=2 (4 ranks): each stage's projections split over its two tp ranks as the whole model's
    plan says, the hidden states between stages replicated over tp, the last stage's loss on vocabulary
    shards (``loss_parallel``), the norm summed over stages and TP placements: one process's numbers."""
    path, ref = llama
    assert_parity(run_ranks(jobs_losses, 4, [(path, "pp2_tp2")])[0], ref, label="pp2 x tp2")
