"""Parity is the definition of correct: every layout reproduces one-process training step by step.

The reference is a plain transformers + torch loop (``helpers.plain_reference``), not shardlm.
Same global batch of 4 sequences everywhere, fp32, clipping active (max_grad_norm 0.5 binds),
weight decay, warmup + cosine, padded and wholly-ignored samples.
"""

import pytest
from helpers import assert_parity, plain_reference, run_ranks, shardlm_losses, write_model_dir

pytestmark = pytest.mark.ranks  # every test here starts processes or a process group

GLOBAL_BATCH = 4
# name -> (family, config overrides): GQA with kv heads == tp, MHA with tied embeddings, q/k/v bias
MODELS = {
    "llama_gqa": ("llama", {}),
    "llama_tied_mha": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "qwen2_bias": ("qwen2", {}),
}
# (every other family is checked at tp=2, tp=4 and tp=2 x fsdp=2 in test_autotp.py)
# layout, per-device batch, accumulation: the global batch is always 4
LAYOUTS = {
    "one_process": ({}, 2, 2),
    "tp2": ({"tp": 2}, 4, 1),
    "fsdp2": ({"fsdp": 2}, 1, 2),
    "dp_replicate2": ({"dp_replicate": 2}, 2, 1),
    "tp2_fsdp2": ({"tp": 2, "fsdp": 2}, 2, 1),
    "dp_replicate2_tp2": ({"dp_replicate": 2, "tp": 2}, 1, 2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    paths = {name: write_model_dir(str(root / name), fam, **kw) for name, (fam, kw) in MODELS.items()}
    refs = {name: plain_reference(path, GLOBAL_BATCH) for name, path in paths.items()}
    return paths, refs


def layouts_losses(paths: list[str], names: list[str]) -> dict:
    """Rank body: the layouts of ``names`` one after another in one world (a spawn costs ~8 s)."""
    return {name: shardlm_losses(paths, *LAYOUTS[name]) for name in names}


# layouts that share a world size run in one spawn; the 4-rank ones measured slower together
GROUPS = [["one_process"], ["tp2", "fsdp2", "dp_replicate2"], ["tp2_fsdp2"], ["dp_replicate2_tp2"]]


@pytest.mark.parametrize("names", GROUPS, ids=["+".join(g) for g in GROUPS])
def test_layout_matches_one_process(models, names):
    paths, refs = models
    world = 1
    for size in LAYOUTS[names[0]][0].values():
        world *= size
    got = run_ranks(layouts_losses, world, list(paths.values()), names)
    for layout_name in names:
        for name, path in paths.items():
            assert_parity(got[layout_name][path], refs[name], label=f"{layout_name} {name}")
