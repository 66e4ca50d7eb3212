"""What the tests share: the two tiers, the in-process world, and the checkpointed runs.

Tiers: a test marked ``ranks`` starts real processes (gloo ranks on localhost, or the CLI in a
subprocess) or a process group in this process; everything else is the fast tier, run alone by
``make test-fast`` (``pytest -m "not ranks and not sweep"``: ``sweep`` marks the few process-free tests that
plan a dozen model types or more). Rank bodies themselves live in ``helpers.py``:
they run in spawned processes, where fixtures do not exist.
"""

from __future__ import annotations

import pool
import pytest
import torch.distributed as dist
from families import write_tiny_config, write_tiny_dir
from helpers import plain_reference, run_ranks, train_jobs, write_gemma3, write_model_dir

from shardlm import init_distributed


@pytest.fixture
def one_process():
    """In-process one-rank world for cheap single-process runs; torn down afterwards."""
    init_distributed()
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tp2_runs(tmp_path_factory) -> dict:
    """One 2-rank spawn shared by test_checkpoint.py and test_consolidate.py (a spawn costs ~10 s):
    uninterrupted tp=2 runs of a GQA Llama, a tied-embedding MHA Llama, Kimi-Linear (delta
    attention split by heads, its ``A_log`` [1, 1, heads, 1] on dim 2; MLA; MoE) and Qwen3.5 text
    (Gated DeltaNet: ``in_proj_qkv`` of unequal parts and the conv over it, ``PartsShard``) and Zaya
    (its value projections stored by the rows each rank computes, ``RowsShard``: rank 0 all of one, none
    of the other) (saves at 5 and 10), then resumes from step-5: the GQA one at tp=2 and at fsdp=2, the tied one at
    fsdp=2."""
    root = tmp_path_factory.mktemp("ckpt")
    model = write_model_dir(str(root / "llama"), "llama")
    tied = write_model_dir(str(root / "tied"), "llama", num_key_value_heads=4, tie_word_embeddings=True)
    kimi = write_tiny_dir(str(root / "kimi"), "kimi_linear")
    qwen35 = write_tiny_dir(str(root / "qwen35"), "qwen3_5_text")
    zaya = write_tiny_config(str(root / "zaya"), "zaya")
    step5, tied5 = (str(root / run / "checkpoints" / "step-5") for run in ("a", "t"))
    jobs = [
        (model, "tp2", str(root / "a")),
        (tied, "tp2", str(root / "t")),
        (kimi, "tp2", str(root / "k")),
        (qwen35, "tp2", str(root / "q")),
        (zaya, "tp2", str(root / "z")),
        (model, "tp2", str(root / "b"), {"resume": step5}),
        (model, "fsdp2", str(root / "c"), {"resume": step5}),
        (tied, "fsdp2", str(root / "tc"), {"resume": tied5}),
    ]
    full, tied_full, kimi_full, qwen35_full, zaya_full, same, fsdp, tied_fsdp = run_ranks(train_jobs, 2, jobs)
    return dict(
        root=root,
        model=model,
        tied=tied,
        kimi=kimi,
        kimi_full=kimi_full,
        qwen35=qwen35,
        qwen35_full=qwen35_full,
        zaya=zaya,
        zaya_full=zaya_full,
        step5=step5,
        full=full,
        same=same,
        fsdp=fsdp,
        tied_full=tied_full,
        tied_fsdp=tied_fsdp,
    )


@pytest.fixture(scope="session")
def pp_llama(tmp_path_factory) -> tuple[str, list]:
    """The pipeline tests' Llama (4 blocks, untied: two a stage at pp=2, one at pp=4 or two stages a rank)
    and its one-process reference (``helpers.plain_reference``, global batch 4, 5 steps), computed once for
    test_pipeline.py, test_pipeline_stages.py and test_pipeline_composed.py."""
    path = write_model_dir(str(tmp_path_factory.mktemp("pp_llama") / "llama"), "llama", num_hidden_layers=4)
    return path, plain_reference(path, 4)


@pytest.fixture(scope="session")
def pp_families(tmp_path_factory) -> dict[str, tuple[str, list]]:
    """The pipeline tests' other families, 4 blocks each, with their one-process references (as ``pp_llama``),
    computed once for test_pipeline.py, test_pipeline_stages.py and test_pipeline_families.py: Qwen3 whose last
    two blocks slide over 4 tokens (stage 1's ``layer_types`` must be its own blocks'); Gemma 3 (sliding and
    full blocks, untied; ``helpers.write_gemma3``); GPT-2 (learned positions, tied embeddings)."""
    root = tmp_path_factory.mktemp("pp_families")
    sliding = dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)
    paths = {
        "qwen3_sliding": write_model_dir(str(root / "qwen3"), "qwen3", num_hidden_layers=4, **sliding),
        "gemma3": write_gemma3(str(root / "gemma3")),
        "gpt2": write_model_dir(str(root / "gpt2"), "gpt2", n_layer=4),
    }
    return {name: (path, plain_reference(path, 4)) for name, path in paths.items()}


def pytest_sessionfinish(session, exitstatus):
    """Stop the pooled rank processes (tests/pool.py)."""
    pool.shutdown()
