"""Context parallelism (``parallel.cp``): the sequence split between ranks equals one process.

The reference is a plain transformers model trained on one process (``plain`` below: its own
attention and mask, mean cross-entropy, torch's clipping and AdamW); shardlm's runs split every
window of 512 tokens into head-tail chunks between the cp ranks. Losses must agree to 1e-5 and
gradient norms to 1e-4 (relative), fp32, dropout off, on windows of one sequence each and on
document-packed windows (position ids restarting at each document).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from families import VOCAB, write_tiny_dir
from helpers import assert_parity, load_checked, run_ranks, train_config, write_model_dir

from shardlm.data.context_split import chunk_index
from shardlm.data.dataset import GlobalBatchOrder, TokenDataset
from shardlm.data.rows import IGNORE_INDEX
from shardlm.errors import ConfigError
from shardlm.parallel.runtime.context import document_mask

SEQ = 512
STEPS = 3
GLOBAL_BATCH = 4


def cp_data(packed: bool, n: int = 8, seed: int = 3) -> TokenDataset:
    """``n`` windows of ``SEQ`` random tokens, the labels shifted and partly ignored; ``packed``:
    each window holds documents of random lengths (position ids restart at each, its last token
    has no label), some shorter than a cp chunk, some across chunk boundaries."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, -int(torch.randint(1, 40, (1,), generator=g)) :] = IGNORE_INDEX
    labels[1] = IGNORE_INDEX
    if not packed:
        return TokenDataset(ids[:, :-1].clone(), labels)
    positions = torch.empty(n, SEQ, dtype=torch.long)
    for row in range(n):
        start = 0
        while start < SEQ:
            length = min(int(torch.randint(20, 300, (1,), generator=g)), SEQ - start)
            positions[row, start : start + length] = torch.arange(length)
            labels[row, start + length - 1] = IGNORE_INDEX
            start += length
    return TokenDataset(ids[:, :-1].clone(), labels, position_ids=positions)


def write_family(path: str, family: str) -> str:
    """A tiny random ``family`` for windows of ``SEQ``; weights drawn 10x wider than the default
    (std 0.2), so that attention is sharp enough for a wrong key or mask to move the loss."""
    write_model_dir(path, family, max_position_embeddings=2 * SEQ, initializer_range=0.2)
    return path


def plain(model_path: str, data: TokenDataset, steps: int = STEPS) -> list[tuple[float, float]]:
    """One process without shardlm's training code: (loss, grad_norm) per step on the global batch."""
    from transformers import get_scheduler

    from shardlm.parallel.weights.fill import reference_model

    t = train_config(model_path, {}, GLOBAL_BATCH, 1, steps).train
    model = reference_model(model_path, t.seed)
    model.config.use_cache = False
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon)
    sched = get_scheduler(t.lr_scheduler_type, opt, num_warmup_steps=t.warmup_steps, num_training_steps=steps)
    order = GlobalBatchOrder(len(data), GLOBAL_BATCH, t.seed)
    out = []
    for step in range(steps):
        idx = torch.tensor(order.indices(step))
        kwargs = {} if data.position_ids is None else {"position_ids": data.position_ids[idx]}
        logits = model(input_ids=data.input_ids[idx], **kwargs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), data.labels[idx].flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


def cp_runs(jobs: list[tuple], out: str) -> list:
    """Rank body: per job ``(model_path, layout, per_device, accum, packed)``, shardlm's (loss, grad_norm) per step."""
    from shardlm import Trainer, build_mesh, init_distributed, parallelize

    init_distributed()
    results = []
    for path, layout, per_device, accum, packed in jobs:
        cfg = train_config(path, layout, per_device, accum, STEPS, output_dir=out)
        mesh = build_mesh(cfg.parallel)
        trainer = Trainer(parallelize(path, mesh, seed=cfg.train.seed), cfg, cp_data(packed), mesh)
        results.append([(h["loss"], h["grad_norm"]) for h in trainer.train()])
    return results


# ---------------------------------------------------------------- the split and the mask (one process)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunks_cover_the_window_once_head_with_tail(cp):
    held = [chunk_index(32, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(32))
    # head-tail: every rank holds the same number of causal (query, key) pairs
    assert len({int((index + 1).sum()) for index in held}) == 1


@pytest.mark.parametrize("window", [None, 5])
def test_mask_rows_equal_transformers_mask(window):
    """The rows a rank builds, put together, are the mask transformers builds for the whole packed
    window (``masking_utils.sdpa_mask`` with ``find_packed_sequence_indices``), sliding window or not."""
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2, 3], list(range(16))])
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, sliding_window=window)
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(2, 16, 8)
    build = create_causal_mask if window is None else create_sliding_window_causal_mask
    full = build(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)
    for cp in (1, 2, 4):
        for rank in range(cp):
            index = chunk_index(16, cp, rank)
            assert torch.equal(document_mask(positions, index, window), full[:, :, index])


# ---------------------------------------------------------------- refused before spawning


def test_refusals_before_spawning(tmp_path):
    (tmp_path / "d.txt").write_text("hello world\n" * 4)
    llama = write_family(str(tmp_path / "llama"), "llama")
    raw = {"model": llama, "data": {"path": str(tmp_path / "d.txt"), "seq_len": 100}}
    raw["train"] = {"output_dir": str(tmp_path / "out")}
    with pytest.raises(ConfigError) as err:
        load_checked(raw={**raw, "parallel": {"cp": 4}})
    assert str(err.value).startswith("parallel.cp=4 splits each window into 2*cp=8 equal chunks but data.seq_len=100")
    with pytest.raises(ConfigError, match="parallel.cp=2 with parallel.ep=2"):
        load_checked(raw={**raw, "parallel": {"cp": 2, "ep": 2, "fsdp": 2}})
    deltanet = write_tiny_dir(str(tmp_path / "qwen35"), "qwen3_5_text")  # Gated DeltaNet beside attention
    with pytest.raises(ConfigError) as err:
        load_checked(raw={**raw, "model": deltanet, "parallel": {"cp": 2}, "data": {**raw["data"], "packing": False}})
    message = str(err.value)
    assert "\n" not in message and message.startswith("parallel.cp=2: Qwen3_5ForCausalLM's ")
    assert "recurrent state" in message
    assert message.endswith("set parallel.cp: 1 (use parallel.tp or parallel.fsdp instead)")


# ---------------------------------------------------------------- parity with one process


@pytest.mark.ranks
def test_llama_cp2_equals_one_process(tmp_path):
    """Llama at cp=2 (2 ranks, per-device 2 x 2 micro-steps = the global batch of 4), windows of 512
    tokens one sequence each and document-packed: loss 1e-5, grad_norm 1e-4 relative."""
    path = write_family(str(tmp_path / "llama"), "llama")
    jobs = [(path, {"cp": 2}, 2, 2, False), (path, {"cp": 2}, 2, 2, True)]
    got = run_ranks(cp_runs, 2, jobs, str(tmp_path / "out"))
    for (_, _, _, _, packed), steps in zip(jobs, got):
        ref = plain(path, cp_data(packed))
        assert all(math.isfinite(loss) for loss, _ in ref)
        assert_parity(steps, ref, label=f"llama cp=2 packed={packed}")
