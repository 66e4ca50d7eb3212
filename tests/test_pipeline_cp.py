"""Pipeline parallelism with context parallelism (``parallel.pp`` x ``parallel.cp``): each stage's cp ranks
split every window into head-tail chunks as without stages (``data/context_split.py``), the window's
position ids travel with the micro-batch to every stage, and each stage's attention gathers the keys and
values of its cp peers (``parallel/runtime/context.py``).

Against one process (``test_context_parallel.plain``: a plain transformers model on the whole windows, its
own attention and block-diagonal mask of packed documents, mean cross-entropy, torch's clipping and AdamW):
Llama at pp=2 x cp=2 (4 ranks) on document-packed windows of 512 tokens, 3 steps, fp32; loss to 1e-5 and
grad_norm to 1e-4 relative at every step, and the eval loss after training to 1e-5.
"""

from __future__ import annotations

import pytest
from helpers import assert_parity, load_checked, run_ranks, write_model_dir
from test_context_parallel import SEQ, cp_data, cp_runs, plain, write_family

from shardlm import ConfigError

# 2 rows a device x 2 accumulation steps: the global batch of 4, cut by 1F1B into 2 micro-batches of 2 windows
LAYOUT = {"pp": 2, "cp": 2}


@pytest.mark.ranks
def test_pp2_cp2_matches_one_process(tmp_path):
    """pp=2 x cp=2, packed windows: the second stage's attention masks the documents from the window position
    ids it was handed (its hidden states hold only its cp rank's tokens), and the eval pass through the
    stages sees the same shards."""
    path = write_family(str(tmp_path / "llama"), "llama")
    ref, ref_eval = plain(path, cp_data(True), evaluate=True)
    job = (path, LAYOUT, 2, 2, True, {"evaluate": True})
    ((steps, eval_loss),) = run_ranks(cp_runs, 4, [job], str(tmp_path / "out"))
    assert_parity(steps, ref, label="llama pp2 x cp2")
    assert abs(eval_loss - ref_eval) <= 1e-5 * ref_eval, (eval_loss, ref_eval)
    loss = max(abs(a - b) for (a, _), (b, _) in zip(steps, ref))
    norm = max(abs(a - b) / b for (_, a), (_, b) in zip(steps, ref))
    print(f"pp2 x cp2: loss {loss:.1e}, grad_norm {norm:.1e} relative, eval {abs(eval_loss - ref_eval):.1e}")


# pp=2 x cp=2 composed further: name -> (layout, train keys); one 4-rank world, Llama with 4 blocks
COMPOSED = {
    "checkpointed": (LAYOUT, {"gradient_checkpointing": True}),
    "ulysses": ({**LAYOUT, "cp_attention": "ulysses"}, {}),
    "interleaved": ({**LAYOUT, "pp_schedule": "Interleaved1F1B"}, {}),
}


@pytest.mark.ranks
def test_pp2_cp2_composed_matches_one_process(tmp_path):
    """pp=2 x cp=2 (4 ranks) on packed windows with activation checkpointing (each block's recompute, run in the
    schedule's backward, attends over the shard its forward had), with Ulysses attention (heads exchanged
    instead of keys), and with two stages a rank (Interleaved1F1B): one process's loss and grad_norm."""
    path = write_model_dir(str(tmp_path / "llama"), "llama", max_position_embeddings=1024, initializer_range=0.2,
                           num_hidden_layers=4)  # fmt: skip
    ref = plain(path, cp_data(True))
    jobs = [(path, layout, 2, 2, True, train) for layout, train in COMPOSED.values()]
    for run, steps in zip(COMPOSED, run_ranks(cp_runs, 4, jobs, str(tmp_path / "out")), strict=True):
        assert_parity(steps, ref, label=f"llama pp2 x cp2 {run}")
        loss = max(abs(a - b) for (a, _), (b, _) in zip(steps, ref))
        norm = max(abs(a - b) / b for (_, a), (_, b) in zip(steps, ref))
        print(f"pp2 x cp2 {run}: loss {loss:.1e}, grad_norm {norm:.1e} relative")


def test_pp_with_cp_passes_the_checks(tmp_path):
    """pp=2 x cp=2 is accepted before spawning, with activation checkpointing, Ulysses and several stages a rank
    too; with sequence parallelism it is refused in one line naming the key and the fix."""
    path = write_model_dir(str(tmp_path / "llama"), "llama", max_position_embeddings=1024, num_hidden_layers=4)
    (tmp_path / "d.txt").write_text("a b c\n")
    train = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    raw = {"model": path, "data": {"path": str(tmp_path / "d.txt"), "seq_len": SEQ}, "train": train}
    assert load_checked(raw={**raw, "parallel": LAYOUT}).parallel.world_size == 4
    for layout, extra in COMPOSED.values():
        assert load_checked(raw={**raw, "parallel": layout, "train": {**train, **extra}}).parallel.cp == 2
    sp = {**LAYOUT, "tp": 2, "sequence_parallel": True}
    match = "^parallel.cp=2 with parallel.pp=2 and parallel.sequence_parallel is not supported yet: "
    with pytest.raises(ConfigError, match=match) as info:
        load_checked(raw={**raw, "parallel": sp})
    assert "\n" not in str(info.value) and "or parallel.cp: 1" in str(info.value)
