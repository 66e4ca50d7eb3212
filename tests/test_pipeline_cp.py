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
from helpers import assert_parity, load_checked, run_ranks
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


def test_pp_with_cp_passes_the_checks(tmp_path):
    """pp=2 x cp=2 is accepted before spawning; with activation checkpointing, Ulysses, sequence parallelism
    or several stages a rank it is refused in one line naming the key and the fix."""
    path = write_family(str(tmp_path / "llama"), "llama")
    (tmp_path / "d.txt").write_text("a b c\n")
    train = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    raw = {"model": path, "data": {"path": str(tmp_path / "d.txt"), "seq_len": SEQ}, "train": train}
    assert load_checked(raw={**raw, "parallel": LAYOUT}).parallel.world_size == 4
    cases = [
        ({}, {"gradient_checkpointing": True}, "train.gradient_checkpointing is not supported yet"),
        ({"cp_attention": "ulysses"}, {}, "parallel.cp_attention=ulysses is not supported yet"),
        ({"tp": 2, "sequence_parallel": True}, {}, "parallel.sequence_parallel is not supported yet"),
        ({"pp_schedule": "Interleaved1F1B"}, {}, r"parallel.pp_schedule=Interleaved1F1B \(several stages a rank\)"),
    ]
    for parallel, extra, match in cases:
        with pytest.raises(ConfigError, match=f"^parallel.cp=2 with parallel.pp=2 and {match}") as info:
            load_checked(raw={**raw, "parallel": {**LAYOUT, **parallel}, "train": {**train, **extra}})
        assert "\n" not in str(info.value) and "or parallel.cp: 1" in str(info.value)
