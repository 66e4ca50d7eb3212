"""Parity past the tiny length: code paths that start only at longer sequences, run at tp=2.

The other parity checks train on 16 tokens a sample (``helpers.SEQ``), shorter than every window, block,
chunk and compressor a tiny config keeps from its published config (``scripts/tiny.py`` shrinks widths,
not these): the code behind them never ran split. Here a few types whose length-dependent path holds
per-head or shared state train 3 steps at tp=2 on samples that cross it, against the plain one-process
loop (``helpers.plain_reference``), tolerances of the issue (loss 1e-5, grad_norm 1e-4 relative):

* DeepSeek-V4 at 263 tokens: its one shared key=value head and compressors kept whole on every rank
  (``parallel/infer/shared_kv.py``), the query heads split; two of the heavily compressed layers' 128-token
  windows, the sparse layer's 4-token ones, the 128-token sliding window over the raw keys;
* gpt-oss at 160: the 128-token sliding window of its first layer with the per-head sinks beside the scores;
* MiMo-V2-Flash at 160: its sliding layer (129 tokens) with twice the full layers' kv heads and per-head sinks;
* MiniMax at 263: lightning attention in blocks of 256, each head's key-value state carried to the next
  block with that head's decay (its slopes and decays sliced to the rank's heads, ``Plan.head_inputs``);
* Mamba-2 at 48: the SSD scan in chunks of 16, each head's state passed between chunks, its one group's B and
  C computed whole by every rank.

Chosen from every type's tiny config: the ones whose threshold is under ~600 tokens (sliding windows of
128-512, Inkling's 512, BLT's 512, GPT-Neo's 256, LFM3's 256, chunked delta rules of 64, SSD chunks of 16) were
all measured once at parity at a length past it; so were, once, at 2060-2200 tokens, the top-k over 2048
positions of DeepSeek-V3.2's, GLM-DSA's and HY-v4's indexers, DeepSeek-V4's CSA indexer (512 of its
compressed entries), Doge's dynamic mask (2048 kept keys per head) and MiniMax-M3's block indexer (16 blocks
of 128): too slow for the suite (up to 40 s a type at tp=2). Gemma 2/3's and Cohere2's 4096-token windows and
Llama 4's chunks of 8192 were not run. The length is checked against the thresholds the config says, so a
config that moved them would fail here rather than pass unengaged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from families import write_tiny_config
from helpers import assert_parity, plain_reference, run_ranks, shardlm_losses

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import tiny_config  # noqa: E402

# model type -> (tokens a sample, the config's sizes it must exceed: an int, or a dict of them by layer kind)
WINDOWS = {
    "deepseek_v4": (263, ("sliding_window", "compress_rates")),
    "gpt_oss": (160, ("sliding_window",)),
    "mimo_v2_flash": (160, ("sliding_window",)),
    "minimax": (263, ("block_size",)),
    "mamba2": (48, ("chunk_size",)),
}
STEPS = 3
BATCH = 2  # the global batch: per device at tp=2; one a data-parallel rank at tp2 x fsdp2
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")


def _thresholds(config, names: tuple[str, ...]) -> list[int]:
    values = [getattr(config, name) for name in names]
    return [v for value in values for v in (value.values() if isinstance(value, dict) else [value])]


def _write(root: Path, model_type: str) -> str:
    """The tiny config, its positions (128 in ``scripts/tiny.py``) raised to cover the samples."""
    length, _ = WINDOWS[model_type]
    config = tiny_config(model_type)
    positions = {n: max(v, 2 * length) for n in POSITIONS if isinstance(v := getattr(config, n, None), int)}
    return write_tiny_config(str(root / model_type), model_type, positions)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    return {t: _write(root, t) for t in WINDOWS}


def test_samples_cross_every_window():
    """Each type's samples are longer than its windows, blocks and chunks (two whole compressor windows for
    DeepSeek-V4's heavily compressed layers: a window is pooled once it is full)."""
    for model_type, (length, names) in WINDOWS.items():
        thresholds = _thresholds(tiny_config(model_type), names)
        assert thresholds and all(isinstance(t, int) and 0 < t < length for t in thresholds), (model_type, thresholds)
    rates = tiny_config("deepseek_v4").compress_rates
    assert 2 * rates["heavily_compressed_attention"] <= WINDOWS["deepseek_v4"][0], rates


def windows_body(paths: dict[str, int], layout: dict, per_device: int) -> dict:
    """Rank body: each model trained on samples of its own length."""
    return {path: shardlm_losses([path], layout, per_device, 1, STEPS, seq=seq)[path] for path, seq in paths.items()}


@pytest.mark.ranks
def test_tp2_matches_one_process_past_the_windows(dirs):
    paths = {dirs[t]: length for t, (length, _) in WINDOWS.items()}
    losses = run_ranks(windows_body, 2, paths, {"tp": 2}, BATCH)
    for model_type, (length, _) in WINDOWS.items():
        ref = plain_reference(dirs[model_type], BATCH, STEPS, seq=length)
        assert_parity(losses[dirs[model_type]], ref, label=f"{model_type} at {length} tokens")


@pytest.mark.ranks
def test_deepseek_v4_tp2_fsdp2_matches_one_process_past_the_windows(dirs):
    path, length = dirs["deepseek_v4"], WINDOWS["deepseek_v4"][0]
    losses = run_ranks(windows_body, 4, {path: length}, {"tp": 2, "fsdp": 2}, BATCH // 2)
    ref = plain_reference(path, BATCH, STEPS, seq=length)
    assert_parity(losses[path], ref, label=f"deepseek_v4 tp2xfsdp2 at {length} tokens")
