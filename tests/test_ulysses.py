"""``parallel.cp_attention: ulysses`` (all-to-all over heads, ``parallel/runtime/ulysses.py``) equals one process.

The reference is the plain one-process transformers run of ``test_context_parallel.plain``; the
windows (512 tokens, packed and not) and the tiny families are that file's. Losses agree to 1e-5 and
gradient norms to 1e-4 (relative), fp32, dropout off. The refusals (heads that do not divide by cp,
attention dropout, an unknown value) are one line each, before spawning.
"""

from __future__ import annotations

import pytest
from helpers import assert_parity, load_checked, run_ranks, write_model_dir
from test_context_parallel import LONG, SEQ, cp_data, cp_runs, plain, saved_bytes_per_rank, write_family

from shardlm.errors import ConfigError

ULYSSES = {"cp": 2, "cp_attention": "ulysses"}
STEPS = 4


def test_ulysses_refusals_before_spawning(tmp_path):
    (tmp_path / "d.txt").write_text("hello world\n" * 4)
    llama = write_family(str(tmp_path / "llama"), "llama")  # 4 query heads, 2 key/value heads
    raw = {"model": llama, "data": {"path": str(tmp_path / "d.txt"), "seq_len": 64, "packing": False}}
    raw["train"] = {"output_dir": str(tmp_path / "out")}
    assert load_checked(raw={**raw, "parallel": ULYSSES}).parallel.cp_attention == "ulysses"
    assert load_checked(raw={**raw, "parallel": {"cp": 2}}).parallel.cp_attention == "all_gather"
    with pytest.raises(ConfigError) as err:
        load_checked(raw={**raw, "parallel": {"cp": 2, "cp_attention": "ring"}})
    assert str(err.value) == (
        "parallel.cp_attention must be one of all_gather, ulysses, got 'ring'; "
        "set parallel.cp_attention: all_gather (the default) or ulysses"
    )
    six = {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48}
    three = write_model_dir(str(tmp_path / "three"), "llama", **six)
    cases = [
        (llama, {"cp": 4}, "its 2 key/value heads do not divide by cp=4"),
        (llama, {"cp": 2, "tp": 2}, "its 1 key/value heads per tp rank (of 2) do not divide by cp=2"),
        (three, {"cp": 2, "tp": 2}, "its 3 query heads per tp rank (of 2) do not divide by cp=2"),
    ]
    for model, layout, why in cases:
        with pytest.raises(ConfigError) as err:
            load_checked(raw={**raw, "model": model, "parallel": {**layout, "cp_attention": "ulysses"}})
        message = str(err.value)
        assert "\n" not in message and why in message, message
        assert message.startswith(f"parallel.cp={layout['cp']} with parallel.cp_attention=ulysses: LlamaForCausalLM")
        assert message.endswith("; set parallel.cp_attention: all_gather")
    for extra, key in (
        ({"parallel": {**ULYSSES, "tp": 2, "sequence_parallel": True}}, "parallel.sequence_parallel"),
        ({"parallel": ULYSSES, "lora": {}}, "lora"),
    ):
        with pytest.raises(ConfigError) as err:
            load_checked(raw={**raw, **extra})
        assert str(err.value).startswith(f"parallel.cp_attention=ulysses with {key} is not supported yet"), err.value
    gpt2 = write_model_dir(str(tmp_path / "gpt2"), "gpt2", attn_pdrop=0.1)
    with pytest.raises(ConfigError, match=r"attention dropout \(attn_pdrop=0.1\)"):
        load_checked(raw={**raw, "model": gpt2, "parallel": ULYSSES})


@pytest.mark.ranks
def test_ulysses_cp2_equals_one_process(tmp_path):
    """cp=2 (2 ranks) with Ulysses attention, 4 steps: Llama one sequence a window and packed,
    Qwen3 (q/k norms) packed, Gemma 3 (sliding window 64 < a chunk of 256) packed and not: loss
    1e-5, grad_norm 1e-4 relative against one process."""
    llama, qwen3 = write_family(str(tmp_path / "llama"), "llama"), write_family(str(tmp_path / "qwen3"), "qwen3")
    gemma3 = write_family(str(tmp_path / "gemma3"), "gemma3")
    steps = {"steps": STEPS}
    jobs = [
        (llama, ULYSSES, 2, 2, False, steps),
        (llama, ULYSSES, 2, 2, True, steps),
        (qwen3, ULYSSES, 2, 2, True, steps),
        (gemma3, ULYSSES, 2, 2, True, steps),
        (gemma3, ULYSSES, 1, 4, False, steps),
    ]
    got = run_ranks(cp_runs, 2, jobs, str(tmp_path / "out"))
    assert SEQ == 512
    for (path, _, _, _, packed, _), result in zip(jobs, got):
        assert_parity(result, plain(path, cp_data(packed), steps=STEPS), label=f"{path} ulysses cp=2 packed={packed}")


@pytest.mark.ranks
def test_ulysses_saved_bytes_at_4096_match_estimate(tmp_path):
    """At 4096 tokens a window, cp=2 (2 real ranks), the bytes a rank saves for backward under each
    ``cp_attention`` are ``shardlm estimate --cp 2 --cp-attention``'s activations within 10%
    (measured on a Llama of hidden 256, 8 heads, 4 kv heads, 2 layers, fp32: all_gather 118.7 MiB,
    estimate 118.2; ulysses 146.7 MiB, estimate 142.2): Ulysses keeps 1/cp of the window's keys and
    values (8 MiB less over 2 layers) but the whole ``seq x seq`` mask (32 MiB more)."""
    from shardlm.estimate.memory import estimate

    path = str(tmp_path / "wide")
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
    write_model_dir(path, "llama", max_position_embeddings=2 * LONG, **shape)
    got = {a: run_ranks(saved_bytes_per_rank, 2, path, 1, a) for a in ("all_gather", "ulysses")}
    for attention, measured in got.items():
        want = estimate(path, batch=1, seq=LONG, cp=2, cp_attention=attention).bytes["activations"]
        assert abs(measured - want) <= 0.10 * measured, (attention, measured, want)
    mask_growth = 4 * LONG * LONG // 2  # the mask's other half of the rows, fp32
    kv_saving = 2 * 2 * (4 * LONG * 8 * 32 // 2)  # 2 layers x k, v: half the window's repeated heads, fp32
    assert abs(got["ulysses"] - got["all_gather"] - (mask_growth - kv_saving)) <= 0.2 * mask_growth, got


@pytest.mark.ranks
def test_ulysses_tp2_cp2_and_cp4_equal_one_process(tmp_path):
    """4 ranks with Ulysses, packed windows, 3 steps, against one process (loss 1e-5, grad_norm 1e-4
    relative): tp=2 x cp=2, a Llama with 4 query and 4 key/value heads (2 of each per tp rank, 1 per cp
    rank after the all-to-all); cp=4, a Llama with 8 query and 4 key/value heads (2 query heads and their
    one key/value head per cp rank: GQA's pairing across the all-to-all), packed and one sequence a window."""
    path, gqa = str(tmp_path / "llama"), str(tmp_path / "llama_gqa")
    write_model_dir(path, "llama", max_position_embeddings=2 * SEQ, initializer_range=0.2, num_key_value_heads=4)
    heads = {"num_attention_heads": 8, "num_key_value_heads": 4}
    write_model_dir(gqa, "llama", max_position_embeddings=2 * SEQ, initializer_range=0.2, **heads)
    cp4, steps = {"cp": 4, "cp_attention": "ulysses"}, {"steps": 3}
    jobs = [
        (path, {"tp": 2, **ULYSSES}, 2, 2, True, steps),
        (gqa, cp4, 4, 1, True, steps),
        (gqa, cp4, 2, 2, False, steps),
    ]
    got = run_ranks(cp_runs, 4, jobs, str(tmp_path / "out"))
    for (model, layout, _, _, packed, _), result in zip(jobs, got):
        assert_parity(result, plain(model, cp_data(packed), steps=3), label=f"{model} {layout} packed={packed}")
