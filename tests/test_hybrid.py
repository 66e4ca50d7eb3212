"""Hybrid models under TP: Qwen3.5's Gated DeltaNet linear attention split by heads (``parallel/channels.py``).

The plan is derived from the dataflow: the fused q/k/v projection is found packed where its
output is split after the depthwise convolution, the conv1d and the per-head ``A_log``/``dt_bias``
follow the channels of the projection they act on (``per_channel``), the gated norm per value head
stays whole (``replicate_grad_allreduce``), the sizes the mixer's forward reads are made local.
Parity with one process at tp=2 and tp=2 x fsdp=2, the collectives and the per-rank elements are
checked in ``test_autotp.py``'s spawns (the model is ``families.TINY``'s ``qwen3_5_text``).
"""

from __future__ import annotations

import pytest
from families import write_tiny_dir

MIXER = "model.layers.0.linear_attn"


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> str:
    return write_tiny_dir(str(tmp_path_factory.mktemp("hybrid") / "qwen3_5_text"), "qwen3_5_text")


def test_gated_deltanet_is_split_by_heads(qwen35, capsys):
    from shardlm.cli import main
    from shardlm.parallel.autotp import describe_plan, infer_plan
    from shardlm.parallel.build import build_meta_model

    model = build_meta_model(qwen35)
    plan = infer_plan(model, 2)
    styles = {f[len(MIXER) + 1 :] or "": s for f, s in plan.styles.items() if f.startswith(MIXER)}
    assert styles == {
        "": "per_channel",  # owns A_log, dt_bias; uses conv1d.weight directly
        "conv1d": "per_channel",
        "norm": "replicate_grad_allreduce",  # weight [head_v_dim], shared by the heads
        "in_proj_qkv": "packed_colwise",
        "in_proj_z": "colwise",
        "in_proj_b": "colwise",
        "in_proj_a": "colwise",
        "out_proj": "rowwise",
    }
    assert not plan.replicated
    # 2 key heads of 16, 4 value heads of 16: [key, key, value] cut after the conv
    assert plan.parts[f"{MIXER}.in_proj_qkv"] == [32, 32, 64]
    # unequal parts: stored whole, each rank its key head and the two value heads it serves
    assert plan.sliced[f"{MIXER}.in_proj_qkv"] == [[(0, 16), (32, 48), (64, 96)], [(16, 32), (48, 64), (96, 128)]]
    assert plan.channels[MIXER] == {"A_log": f"{MIXER}.in_proj_a", "dt_bias": f"{MIXER}.in_proj_a"}
    assert plan.channels[f"{MIXER}.conv1d"] == {"weight": f"{MIXER}.in_proj_qkv"}
    assert plan.local_sizes[MIXER] == {"key_dim": 16, "value_dim": 32}  # read by its split; not hidden_size
    rows = {r["module"]: r for r in describe_plan(model, plan, 2)}
    assert rows[MIXER]["local"] == {"A_log": (2,), "dt_bias": (2,)}
    assert rows[f"{MIXER}.conv1d"]["local"] == {"weight": (128, 1, 4)}  # whole, like in_proj_qkv
    assert "stored whole, each rank uses its rows" in rows[f"{MIXER}.conv1d"]["source"]
    # the 2 key heads cannot be split 4 ways: the mixers stay whole (the dry run at one rank's shapes)
    plan = infer_plan(model, 4)
    assert plan.styles[f"{MIXER}.in_proj_qkv"] == "replicate_local"
    assert "fails at one rank's shapes" in plan.replicated[f"{MIXER}.in_proj_qkv"]
    assert plan.styles["model.layers.2.self_attn.q_proj"] == "colwise"
    assert main(["plan", qwen35, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "A_log split with the output channels of in_proj_a" in out and "kept replicated" not in out
