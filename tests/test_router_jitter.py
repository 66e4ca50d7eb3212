"""A router's random draws in training, keyed like dropout masks, so every layout draws alike.

Phi-MoE's router samples its experts in training (``sparsemixer``: Gumbel noise from
``empty_like(scores).exponential_()``, Heun's mask from ``rand_like``; ``router_jitter_noise``, 0.01
published, is the band of scores it samples among); Mixtral multiplies its input by
``empty_like(h).uniform_(1 - eps, 1 + eps)`` when ``router_jitter_noise > 0``. Under
``DeterministicDropout`` (``parallel/runtime/dropout.py``) these draws are call sites like dropout:
their values are hashes of (seed, step, call site, sample's position in the global batch, index), so
the TP ranks of the replicated router draw the same noise, the data-parallel ranks their samples'
part, and one process (``plain_reference(dropout=True)``: a plain transformers loop under the same
mode) the whole. Parity: loss 1e-5, grad_norm 1e-4 relative, 5 steps, the jitter as published.
"""

from __future__ import annotations

import pytest
import torch
from families import JITTER_TINY as JITTER
from families import write_tiny_config
from helpers import assert_parity, plain_reference, run_ranks

from shardlm.parallel.runtime.dropout import DeterministicDropout, DropoutKey


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("jitter")
    return {
        model_type: write_tiny_config(str(root / model_type), model_type, overrides)
        for model_type, overrides in JITTER.items()
    }


def _draws(key: DropoutKey, x: torch.Tensor) -> list[torch.Tensor]:
    """The router's draws on ``x`` (``[tokens, experts]``) under the mode: rand_like, uniform_, exponential_."""
    with DeterministicDropout(key) as mode:
        drawn = [torch.rand_like(x), torch.empty_like(x).uniform_(0.9, 1.1), torch.empty_like(x).exponential_()]
    assert mode.used and mode.site == 3
    return drawn


def test_draws_are_the_one_process_draws_in_every_layout():
    """Two data-parallel ranks (samples 0-1 and 2-3, tokens flattened) draw the one-process values of
    their samples, a context-parallel rank those of its tokens; a TP rank of a replicated router the
    same as the other; another step differs."""
    whole = _draws(DropoutKey(7, 3, torch.arange(4)), torch.empty(4 * 5, 6))
    halves = [_draws(DropoutKey(7, 3, torch.arange(2) + 2 * r), torch.empty(2 * 5, 6)) for r in range(2)]
    tp_rank = _draws(DropoutKey(7, 3, torch.arange(4), tp_rank=1, tp=2, sites=(None, None, None)), torch.empty(20, 6))
    for i in range(3):
        assert torch.equal(torch.cat([halves[0][i], halves[1][i]]), whole[i]), i
        assert torch.equal(tp_rank[i], whole[i]), i
    rand, uniform, exponential = whole
    assert 0 <= rand.min() and rand.max() < 1 and 0.4 < rand.mean() < 0.6
    assert 0.9 <= uniform.min() and uniform.max() <= 1.1
    assert exponential.min() > 0 and 0.7 < exponential.mean() < 1.3  # finite log: Gumbel noise stays finite
    other = _draws(DropoutKey(7, 4, torch.arange(4)), torch.empty(20, 6))
    assert not torch.equal(other[0], whole[0])
    # context parallelism: a rank holding window positions 0, 1 and 4 of each sample's 5 tokens,
    # flattened as a router sees them, draws those tokens' values
    mine = torch.tensor([0, 1, 4])
    cp_rank = _draws(DropoutKey(7, 3, torch.arange(4), sequence=(mine, 5)), torch.empty(4 * 3, 6))
    for i in range(3):
        assert torch.equal(cp_rank[i], whole[i].view(4, 5, 6)[:, mine].reshape(12, 6)), i


def test_the_plan_keeps_the_router_whole_and_counts_its_draws(dirs):
    """Phi-MoE's router (an ``nn.Linear`` subclass returning its sampled experts) stays whole on every
    rank; its five draws per block (two Gumbel samplings, two Heun masks, one of them redrawn by
    ``uniform_``) are call sites on replicated tensors, after each block's attention dropout (p 0, on
    the split heads)."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model

    meta = build_meta_model(dirs["phimoe"])
    plan = infer_plan(meta, 2)
    assert plan.styles["model.layers.0.mlp.router"] == "replicate_local"
    assert plan.styles["model.layers.0.mlp.experts"] == "experts"
    assert plan.dropout_sites == [-1, None, None, None, None, None] * meta.config.num_hidden_layers


def check_run(result: dict, ref: list, label: str) -> None:
    """Parity with one process; at tp=2 the TP replicas of the replicated parameters (the routers, the
    norms: their gradients come from the drawn routing) bit-identical after the 5 steps."""
    assert_parity(result["history"], ref, label=label)
    if "tp2" in label:
        assert result["compared"] > 0 and result["diff"] == 0.0, (label, result["compared"], result["diff"])


def jitter_body(paths: list[str]) -> list[dict]:
    from test_dropout import run_jobs

    return run_jobs([(path, layout) for path in paths for layout in ("tp2", "fsdp2")])


@pytest.mark.ranks
def test_tp2_and_fsdp2_match_one_process_with_the_jitter_on(dirs):
    paths = list(dirs.values())
    results = iter(run_ranks(jitter_body, 2, paths))
    for model_type, path in dirs.items():
        ref = plain_reference(path, 4, dropout=True)
        for layout in ("tp2", "fsdp2"):
            check_run(next(results), ref, f"{layout} {model_type} jitter")


@pytest.mark.ranks
def test_tp2_fsdp2_matches_one_process_with_the_jitter_on(dirs):
    from test_dropout import run_jobs

    path = dirs["phimoe"]
    (result,) = run_ranks(run_jobs, 4, [(path, "tp2_fsdp2")])
    check_run(result, plain_reference(path, 4, dropout=True), "tp2_fsdp2 phimoe jitter")
