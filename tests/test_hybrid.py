"""Hybrid models under TP: Qwen3.5's Gated DeltaNet linear attention split by heads (``parallel/infer/channels.py``).

The plan is derived from the dataflow: the fused q/k/v projection is found packed where its
output is split after the depthwise convolution, the conv1d and the per-head ``A_log``/``dt_bias``
follow the channels of the projection they act on (``per_channel``), the gated norm per value head
stays whole (``replicate_grad_allreduce``), the sizes the mixer's forward reads are made local.
Parity with one process at tp=2 and tp=2 x fsdp=2, the collectives and the per-rank elements are
checked in ``test_autotp.py``'s spawns (the models of ``families.TINY``).
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
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.describe import describe_plan

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
    # unequal parts, each split on its own (``shards.PartsShard``): each rank its key head of q and of k
    # and the two value heads it serves, not stored whole
    assert f"{MIXER}.in_proj_qkv" not in plan.sliced
    assert plan.channels[MIXER] == {"A_log": f"{MIXER}.in_proj_a", "dt_bias": f"{MIXER}.in_proj_a"}
    assert plan.channels[f"{MIXER}.conv1d"] == {"weight": f"{MIXER}.in_proj_qkv"}
    assert plan.local_sizes[MIXER] == {"key_dim": 16, "value_dim": 32}  # read by its split; not hidden_size
    rows = {r["module"]: r for r in describe_plan(model, plan, 2)}
    assert rows[MIXER]["local"] == {"A_log": (2,), "dt_bias": (2,)}
    assert rows[f"{MIXER}.in_proj_qkv"]["local"] == {"weight": (64, 64)}  # 128 rows of q|k|v, half each
    assert rows[f"{MIXER}.conv1d"]["local"] == {"weight": (64, 1, 4)}  # its channels, split like in_proj_qkv
    assert "stored whole" not in rows[f"{MIXER}.conv1d"]["source"]
    # the 2 key heads cannot be split 4 ways: the mixers stay whole (the dry run at one rank's shapes)
    plan = infer_plan(model, 4)
    assert plan.styles[f"{MIXER}.in_proj_qkv"] == "replicate_local"
    assert "fails at one rank's shapes" in plan.replicated[f"{MIXER}.in_proj_qkv"]
    assert plan.styles["model.layers.2.self_attn.q_proj"] == "colwise"
    assert main(["plan", qwen35, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "A_log split with the output channels of in_proj_a" in out and "kept replicated" not in out


@pytest.fixture(scope="module")
def mixers(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mixers")
    return {name: write_tiny_dir(str(root / name), name) for name in ("qwen3_next", "olmo_hybrid", "lfm3")}


def mixer_plan(path: str, mixer: str):
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.describe import describe_plan

    model = build_meta_model(path)
    plan = infer_plan(model, 2)
    styles = {f[len(mixer) + 1 :] or "": s for f, s in plan.styles.items() if f.startswith(mixer)}
    rows = {
        r["module"][len(mixer) + 1 :] or "": r["local"]
        for r in describe_plan(model, plan, 2)
        if r["module"].startswith(mixer)
    }
    return plan, styles, rows


def test_convolutions_over_reshaped_split_channels_follow_them():
    """A depthwise conv1d meeting split activations that are not one linear's whole output: their
    channel layout (``layouts.py``) says how each rank's channels lie, and the conv follows it."""
    import torch

    from shardlm.parallel.infer.layouts import propagate
    from shardlm.parallel.infer.tracker import ShardTracker

    # LFM's short conv: in_proj [.., 3H] transposed, chunked into B, C, x; the conv over x (H channels)
    tracker = ShardTracker()
    out = torch.empty(1, 13, 24, device="meta")
    tracker.mark(out, frozenset({"in_proj"}))
    tracker.layouts[id(out)], tracker.widths["in_proj"] = (-1, (24,)), 24
    weight = torch.nn.Parameter(torch.empty(8, 1, 3, device="meta"))
    tracker.params = {id(weight): weight}
    with tracker:
        b, c, x = out.transpose(-1, -2).chunk(3, dim=-2)
        torch.nn.functional.conv1d(b * x, weight, groups=8, padding=2)
    assert tracker.follows == {id(weight): (frozenset({"in_proj"}), (8,))} and not tracker.violations
    assert tracker.later_parts["in_proj"] == [8, 8, 8]  # chunk(3): three parts, not parts of 3
    # Qwen3-Next: [.., groups of (q, k, v)] viewed per key head, cut, flattened, concatenated
    layouts = {}
    fused = torch.empty(1, 13, 2 * (4 + 4 + 8), device="meta")
    layouts[id(fused)] = (-1, (32,))
    grouped = fused.view(1, 13, 2, 16)
    propagate("view", (fused, 1, 13, 2, 16), {}, grouped, layouts)
    assert layouts[id(grouped)] == (-2, (2,))  # the key heads
    q, k, v = grouped.split([4, 4, 8], dim=3)
    propagate("split", (grouped, [4, 4, 8], 3), {}, (q, k, v), layouts)
    flat = [t.reshape(1, 13, -1) for t in (q, k, v)]
    for a, b in zip((q, k, v), flat):
        propagate("reshape", (a, 1, 13, -1), {}, b, layouts)
    mixed = torch.cat(flat, dim=-1)
    propagate("cat", (flat, -1), {}, mixed, layouts)
    assert layouts[id(mixed)] == (-1, (8, 8, 16))  # each rank: its chunk of q, of k, of v


def test_linear_attention_and_short_conv_mixers_are_split_by_heads(mixers):
    # Qwen3-Next: q/k/v/z fused per key head (plain colwise: each rank holds whole key heads); the conv
    # over cat(q, k, v) follows their channels, [32, 32, 64], unequal: each part split on its own
    mixer = "model.layers.0.linear_attn"
    plan, styles, local = mixer_plan(mixers["qwen3_next"], mixer)
    assert styles == {
        "": "per_channel",
        "conv1d": "per_channel",
        "in_proj_qkvz": "colwise",
        "in_proj_ba": "colwise",
        "norm": "replicate_grad_allreduce",
        "out_proj": "rowwise",
    }
    assert plan.channel_parts[f"{mixer}.conv1d.weight"] == [32, 32, 64]
    assert f"{mixer}.conv1d.weight" not in plan.channel_rows  # not stored whole
    assert plan.channel_parts[f"{mixer}.A_log"] == plan.channel_parts[f"{mixer}.dt_bias"] == [4]
    assert local[""] == {"A_log": (2,), "dt_bias": (2,)} and local["conv1d"] == {"weight": (64, 1, 4)}
    # the head counts its forward views the fused projections by, and the widths it splits at
    assert plan.local_sizes[mixer] == {"key_dim": 16, "num_k_heads": 1, "num_v_heads": 2, "value_dim": 32}
    assert not [f for f in plan.replicated if "linear_attn" in f]
    # OLMo-hybrid: the conv over cat(q_proj, k_proj, v_proj) follows the three projections
    plan, styles, local = mixer_plan(mixers["olmo_hybrid"], mixer)
    assert {s for n, s in styles.items() if n.endswith("_proj")} == {"colwise", "rowwise"}
    assert plan.channels[f"{mixer}.conv1d"] == {"weight": " + ".join(f"{mixer}.{p}_proj" for p in "kqv")}
    assert plan.channel_parts[f"{mixer}.conv1d.weight"] == [32, 32, 64]
    assert not plan.replicated
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.describe import describe_plan

    rows = {r["module"]: r["source"] for r in describe_plan(build_meta_model(mixers["olmo_hybrid"]), plan, 2)}
    assert rows[f"{mixer}.conv1d"].endswith("weight split with the output channels of k_proj + q_proj + v_proj")
    # LFM3: in_proj packed [B, C, x]; the conv over B * x follows x's part, Shard(0)
    mixer = "model.layers.0.conv"
    plan, styles, local = mixer_plan(mixers["lfm3"], mixer)
    assert styles == {"": "per_channel", "conv": "per_channel", "in_proj": "packed_colwise", "out_proj": "rowwise"}
    assert plan.parts[f"{mixer}.in_proj"] == [64, 64, 64] and plan.channel_parts[f"{mixer}.conv.weight"] == [64]
    assert local["conv"] == {"weight": (32, 1, 7)} and not plan.replicated


def test_kimi_delta_attention_gates_are_latents_and_its_heads_split(tmp_path):
    """Kimi-Linear's delta attention: its forget and output gates are low-rank pairs (hidden ->
    head_dim -> heads x head_dim; the forget gate adds its per-channel ``dt_bias`` before the view
    into heads): the first linear of each is a latent kept whole (``latent.py``), the second split
    by heads; ``A_log`` [1, 1, heads, 1] follows the heads on its dim 2, ``dt_bias`` on dim 0."""
    from shardlm.parallel.plan.styles import ExpertParam

    mixer = "model.layers.0.self_attn"
    plan, styles, local = mixer_plan(write_tiny_dir(str(tmp_path / "kimi"), "kimi_linear"), mixer)
    gate = f"{mixer}.forget_gate"
    assert styles == {
        "": "per_channel",  # uses conv1d.weight directly
        "conv1d": "per_channel",
        "forget_gate": "per_channel",  # owns A_log, dt_bias
        "forget_gate.f_a_proj": "colwise",  # the latents: all rows on every rank (Plan.sliced)
        "g_a_proj": "colwise",
        "forget_gate.f_b_proj": "colwise",
        "g_b_proj": "colwise",
        "q_proj": "colwise",
        "k_proj": "colwise",
        "v_proj": "colwise",
        "b_proj": "colwise",
        "o_norm": "replicate_grad_allreduce",
        "o_proj": "rowwise",
    }
    assert plan.sliced[f"{gate}.f_a_proj"] == plan.sliced[f"{mixer}.g_a_proj"] == [[(0, 16)], [(0, 16)]]
    assert plan.latent_readers[f"{gate}.f_b_proj"] == f"{gate}.f_a_proj"
    assert plan.latent_readers[f"{mixer}.g_b_proj"] == f"{mixer}.g_a_proj"
    assert plan.experts[gate] == {"A_log": ExpertParam(2), "dt_bias": ExpertParam(0)}
    assert local["forget_gate"] == {"dt_bias": (32,), "A_log": (1, 1, 2, 1)}
    assert local["conv1d"] == {"weight": (96, 1, 4)} and local["forget_gate.f_a_proj"] == {"weight": (16, 64)}
    assert not plan.replicated


def test_mamba1_mixers_are_split_by_channels(tmp_path):
    """Mamba-1 (Jamba, Mamba, Falcon-Mamba): in_proj packed [x, z]; x_proj reads the split channels
    (row-parallel) and its whole dt, B, C go back into them (``summed.py``: its output gradient summed
    over TP; Jamba's norms of dt, B, C partial, summed after backward); dt_proj, multiplied directly by
    the mixer (``dt_proj.weight @ dt``), split by rows; A_log [I, N] meets dt's channels through
    ``A[None, :, None, :] * dt[:, :, :, None]`` and follows them, D and the conv follow x's."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.styles import ExpertParam

    mixer = "model.layers.0.mamba"
    plan, styles, local = mixer_plan(write_tiny_dir(str(tmp_path / "jamba"), "jamba"), mixer)
    assert styles == {
        "": "per_channel",  # owns A_log, D; uses conv1d's and dt_proj's parameters directly
        "conv1d": "per_channel",
        "dt_proj": "per_channel",
        "in_proj": "packed_colwise",
        "x_proj": "rowwise",
        "dt_layernorm": "replicate_grad_allreduce",
        "b_layernorm": "replicate_grad_allreduce",
        "c_layernorm": "replicate_grad_allreduce",
        "out_proj": "rowwise",
    }
    assert plan.parts[f"{mixer}.in_proj"] == [128, 128] and f"{mixer}.x_proj" in plan.summed
    assert plan.channels[mixer] == {"A_log": f"{mixer}.dt_proj", "D": f"{mixer}.in_proj"}
    assert plan.experts[f"{mixer}.dt_proj"] == {"weight": ExpertParam(0), "bias": ExpertParam(0)}
    assert local[""] == {"A_log": (64, 8), "D": (64,)} and local["dt_proj"] == {"weight": (64, 8), "bias": (64,)}
    assert local["conv1d"] == {"weight": (64, 1, 4), "bias": (64,)} and local["x_proj"] == {"weight": (24, 64)}
    assert not plan.replicated
    mixer = "backbone.layers.0.mixer"
    for name in ("mamba", "falcon_mamba"):
        plan, styles, local = mixer_plan(write_tiny_dir(str(tmp_path / name), name), mixer)
        assert styles == {
            "": "per_channel",
            "conv1d": "per_channel",
            "dt_proj": "per_channel",
            "in_proj": "packed_colwise",
            "x_proj": "rowwise",
            "out_proj": "rowwise",
        }, name
        assert plan.summed == [f"backbone.layers.{i}.mixer.x_proj" for i in range(2)] and not plan.replicated
        assert plan.styles["backbone.embeddings"] == "embedding" and plan.styles["lm_head"] == "lm_head"
    # LoRA on x_proj would all-reduce its output without summing the gradient back: refused by name
    from shardlm import ConfigError
    from shardlm.config.schema import LoraConfig
    from shardlm.parallel.runtime.lora import check_lora

    model = build_meta_model(write_tiny_dir(str(tmp_path / "mamba"), "mamba"))
    with pytest.raises(ConfigError, match="x_proj' is a row-parallel layer whose output is read back inside"):
        check_lora(LoraConfig(target_modules=["x_proj"]), model, infer_plan(model, 2))
    # nothing else reads a row-parallel output back inside its split channels
    assert not infer_plan(build_meta_model(write_tiny_dir(str(tmp_path / "qwen35"), "qwen3_5_text")), 2).summed


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory) -> str:
    return write_tiny_dir(str(tmp_path_factory.mktemp("mamba2") / "mamba2"), "mamba2")


def test_mamba2_mixer_is_split_by_heads_and_groups(mamba2):
    """Mamba-2 at n_groups=2, tp=2: in_proj cut into [z, xBC, dt] at once and xBC into [x, B, C] after
    the conv: both cuts make its parts (``layouts.Cuts``), the conv follows [x, B, C], the gated norm over
    groups the split keeps whole has its weight follow the channels, and the sizes its forward views by
    are made local, but not ``ssm_state_size``, equal to ``num_heads`` (8) yet sizing B's state dim."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.describe import describe_plan

    mixer = "backbone.layers.0.mixer"
    model = build_meta_model(mamba2)
    plan = infer_plan(model, 2)
    styles = {f[len(mixer) + 1 :] or "": s for f, s in plan.styles.items() if f.startswith(mixer)}
    assert styles == {
        "": "per_channel",  # owns A_log, D, dt_bias; uses conv1d.weight directly
        "conv1d": "per_channel",
        "in_proj": "packed_colwise",
        "norm": "per_channel",
        "out_proj": "rowwise",
    }
    assert not plan.replicated
    assert plan.parts[f"{mixer}.in_proj"] == [128, 128, 16, 16, 8]  # z, x, B (2 groups of 8), C, dt (8 heads)
    assert f"{mixer}.in_proj" not in plan.sliced  # each part split on its own: rank 1 its second half of each
    assert plan.channel_parts[f"{mixer}.conv1d.weight"] == [128, 16, 16]
    assert plan.channel_parts[f"{mixer}.norm.weight"] == [128]
    assert plan.channels[mixer] == dict.fromkeys(("A_log", "D", "dt_bias"), f"{mixer}.in_proj")
    assert plan.local_sizes[mixer] == {"conv_dim": 80, "intermediate_size": 64, "n_groups": 1, "num_heads": 4}
    rows = {r["module"]: r["local"] for r in describe_plan(model, plan, 2)}
    assert rows[mixer] == {"A_log": (4,), "D": (4,), "dt_bias": (4,)}
    assert rows[f"{mixer}.norm"] == {"weight": (64,)} and rows[f"{mixer}.conv1d"]["weight"] == (80, 1, 4)
    assert rows[f"{mixer}.in_proj"]["weight"] == (148, 64)  # 296 rows of [z, x, B, C, dt], half each


def test_cuts_of_a_stretch_of_a_linear_refine_its_parts():
    """``layouts.Cuts``: a cut of a piece of a linear's output, after a transpose and a per-channel op,
    is a cut of the linear at those columns; a regrouping view drops the origin."""
    import torch

    from shardlm.parallel.infer.layouts import Cuts, propagate

    layouts, cuts = {}, Cuts()
    out = torch.empty(1, 13, 40, device="meta")
    layouts[id(out)], cuts.origins[id(out)] = (-1, (40,)), ("in_proj", 0)
    z, xbc, dt = out.split([8, 28, 4], dim=-1)
    propagate("split", (out, [8, 28, 4]), {"dim": -1}, (z, xbc, dt), layouts, cuts)
    t = xbc.transpose(1, 2)
    propagate("transpose", (xbc, 1, 2), {}, t, layouts, cuts)
    act = torch.nn.functional.silu(t)
    propagate("silu", (t,), {}, act, layouts, cuts)
    back = act.transpose(1, 2)
    propagate("transpose", (act, 1, 2), {}, back, layouts, cuts)
    x, b, c = back.split([20, 4, 4], dim=-1)
    propagate("split", (back, [20, 4, 4], -1), {}, (x, b, c), layouts, cuts)
    assert cuts.parts("in_proj", 0, 40) == (8, 20, 4, 4, 4)
    assert cuts.parts("in_proj", 8, 28) == (20, 4, 4)  # what the conv over xBC follows
    heads = x.view(1, 13, 5, 4)
    propagate("view", (x, 1, 13, 5, 4), {}, heads, layouts, cuts)
    assert layouts[id(heads)] == (-2, (5,)) and id(heads) not in cuts.origins


def test_permutes_and_einsums_move_the_split_dim_by_position_not_by_size():
    """Mamba-2's chunk scan (``mamba2_chunk_scan``) permutes per-head decays and contracts them in
    einsums; in the tiny configs the head count equals the state and chunk sizes (8, 16), so a layout
    judged by size would land on the wrong dim (and a wrong dim summed over holds dt whole: Bamba's and
    Falcon-H1's mixers were kept replicated after the Mamba-1 and Mamba-2 work merged)."""
    import torch

    from shardlm.parallel.infer.layouts import Cuts, propagate

    layouts, cuts = {}, Cuts()
    a = torch.empty(1, 2, 16, 8, device="meta")  # [b, c, l, h], h split
    layouts[id(a)], cuts.origins[id(a)] = (-1, (8,)), ("in_proj", 272)
    p = a.permute(0, 3, 1, 2)  # [b, h, c, l]: l (16) is not h even where h is 16
    propagate("permute", (a, 0, 3, 1, 2), {}, p, layouts, cuts)
    assert layouts[id(p)] == (-3, (8,)) and cuts.origins[id(p)] == ("in_proj", 272)
    back = p.permute(0, -2, -1, 1)
    propagate("permute", (p, 0, -2, -1, 1), {}, back, layouts, cuts)
    assert layouts[id(back)] == (-1, (8,))
    decay = torch.empty(1, 3, 3, 8, device="meta")  # [b, z, c, h]
    states = torch.empty(1, 3, 8, 16, 8, device="meta")  # [b, z, h, p, n], n == h == 8
    layouts[id(decay)], layouts[id(states)] = (-1, (8,)), (-3, (8,))
    out = torch.einsum("bzch,bzhpn->bchpn", decay, states)
    propagate("einsum", ("bzch,bzhpn->bchpn", decay, states), {}, out, layouts, cuts)
    assert layouts[id(out)] == (-3, (8,))  # h, not n
    c = torch.empty(1, 2, 16, 8, 8, device="meta")  # B over its split state dim n: no layout
    layouts[id(c)] = (-1, (8,))
    g = torch.einsum("bclhn,bcshn->bclsh", c, c)
    propagate("einsum", ("bclhn,bcshn->bclsh", c, c), {}, g, layouts, cuts)
    assert id(g) not in layouts


def test_ints_sizing_only_unsplit_dims_are_not_made_local():
    import torch

    from shardlm.parallel.infer.sizes import NamedInt, record_uses, used_only

    layouts, uses = {}, {}
    b = torch.empty(1, 13, 16, device="meta")
    layouts[id(b)] = (-1, (16,))
    groups, state = NamedInt(2, "mixer", "n_groups"), NamedInt(8, "mixer", "ssm_state_size")
    out = b.view(1, 13, groups, state)
    layouts[id(out)] = (-2, (2,))
    record_uses("view", (b, 1, 13, groups, state), {}, out, layouts, uses)
    assert uses == {"mixer": {"n_groups": {"split"}, "ssm_state_size": {"whole"}}}
    assert used_only(uses, "whole") == {"mixer": {"ssm_state_size"}} and used_only(uses, "split") == {
        "mixer": {"n_groups"}
    }


@pytest.fixture(scope="module")
def one_group(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("one_group")
    return {name: write_tiny_dir(str(root / name), name) for name in ("bamba", "falcon_h1")}


def test_mamba2_groups_fewer_than_tp_are_held_whole(one_group):
    """n_groups=1 < tp=2 (Bamba, Falcon-H1 as published): B and C are summed over their state dim (an
    einsum over their split channels), so they are held whole on every rank, like kv heads fewer than
    tp: in_proj stored whole, each rank computing its chunk of z, x, dt and all of B and C; the conv the
    same; ``conv_dim`` on one rank is x/2 + B + C; the gated norm over the whole split width all-reduces
    its sum of squares (``sharded_norm`` with the gate); Falcon-H1's ``mup_vector`` follows in_proj."""
    mixer = "model.layers.0.mamba"
    plan, styles, local = mixer_plan(one_group["bamba"], mixer)
    assert styles == {
        "": "per_channel",
        "conv1d": "per_channel",
        "in_proj": "packed_colwise",
        "norm": "sharded_norm",
        "out_proj": "rowwise",
    }
    assert not plan.replicated
    assert plan.parts[f"{mixer}.in_proj"] == [128, 128, 8, 8, 8]
    assert plan.whole_parts[f"{mixer}.in_proj"] == [False, False, True, True, False]
    assert plan.sliced[f"{mixer}.in_proj"][1] == [(64, 128), (192, 256), (256, 264), (264, 272), (276, 280)]
    assert plan.channel_rows[f"{mixer}.conv1d.weight"][1] == [(64, 128), (128, 136), (136, 144)]
    assert plan.local_sizes[mixer] == {"conv_dim": 80, "intermediate_size": 64, "num_heads": 4}  # n_groups stays 1
    assert local["norm"] == {"weight": (64,)} and local[""] == {"A_log": (4,), "D": (4,), "dt_bias": (4,)}
    plan, styles, _ = mixer_plan(one_group["falcon_h1"], mixer)
    assert styles[""] == "per_channel" and "norm" not in styles  # mamba_rms_norm=False: no norm
    assert plan.channels[mixer]["mup_vector"] == f"{mixer}.in_proj"  # a buffer: each rank uses its rows
    assert plan.local_sizes[mixer] == {"conv_dim": 80, "intermediate_size": 64, "num_heads": 8}  # 16 = head_dim


@pytest.mark.sweep  # 1.9 s of planning idle: out of the fast tier, in make test
def test_zamba2_shared_block_and_its_adapters_split_in_every_hybrid_layer(tmp_path):
    """Zamba2 (published sizes shrunk, two hybrid layers sharing one block): the shared attention and MLP
    split in both layers; each per-invocation adapter's down-projection is kept whole (a latent: its
    up-projection is added to the packed gate_up_proj, split part by part like it), and the adapter a layer
    never runs takes the placement of the layer that does (one tensor); only the hybrid ``linear``, added
    to the residual stream whole, is kept whole, and the mixer after it splits by heads."""
    from families import write_tiny_config

    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model

    plan = infer_plan(build_meta_model(write_tiny_config(str(tmp_path / "zamba2"), "zamba2")), 2)
    assert sorted(plan.replicated) == ["model.layers.2.linear", "model.layers.3.linear"]
    assert "adds its output to a whole activation of its width" in plan.replicated["model.layers.2.linear"]
    for layer in (2, 3):
        block, ff = f"model.layers.{layer}.shared_transformer", f"model.layers.{layer}.shared_transformer.feed_forward"
        assert {plan.styles[f"{block}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")} == {"colwise"}
        assert plan.styles[f"{block}.self_attn.o_proj"] == plan.styles[f"{ff}.down_proj"] == "rowwise"
        assert plan.parts[f"{ff}.gate_up_proj"] == [128, 128]
        for adapter in (0, 1):
            down, up = f"{ff}.gate_up_proj_adapter_list.{adapter}.0", f"{ff}.gate_up_proj_adapter_list.{adapter}.1"
            assert plan.styles[down] == "colwise" and plan.sliced[down] == [[(0, 128)], [(0, 128)]]
            assert plan.styles[up] == "packed_colwise" and plan.parts[up] == [128, 128]
            assert plan.latent_readers[up] == down
        assert plan.styles[f"model.layers.{layer}.mamba_decoder.mamba.in_proj"] == "packed_colwise"


def test_fsdp_groups_of_hybrid_layers_tied_blocks_and_reversible_layers(tmp_path):
    """FSDP's groups (``build.apply_fsdp``): Zamba2's decoder blocks are its layers of two kinds (by its own
    ``_no_split_modules``; the one-class rule had taken a shared layer's two adapters for the blocks), the
    shared transformer's copies in layers 2 and 3, whose parameters are tied, one group of their own (FSDP2
    manages a parameter in one group: tp2 x fsdp2 had raised), and Reformer's reversible layers kept unsharded
    after their forward (rerun in its backward outside their hooks: tp2 x fsdp2 had met their shards).
    Parity at tp2 x fsdp2 is the matrix's (scripts/matrix.py: FSDP_SUBSET)."""
    from families import write_tiny_config

    from shardlm.parallel.model.meta import build_meta_model, decoder_blocks, recomputed_in_backward, shared_modules

    zamba2 = build_meta_model(write_tiny_config(str(tmp_path / "zamba2"), "zamba2"))
    names = {id(m): n for n, m in zamba2.named_modules(remove_duplicate=False)}
    assert [names[id(b)] for b in decoder_blocks(zamba2)] == [f"model.layers.{i}" for i in range(4)]
    groups = [[names[id(m)] for m in group] for group in shared_modules(decoder_blocks(zamba2))]
    assert groups == [["model.layers.2.shared_transformer", "model.layers.3.shared_transformer"]]
    assert not any(map(recomputed_in_backward, decoder_blocks(zamba2)))
    reformer = build_meta_model(write_tiny_config(str(tmp_path / "reformer"), "reformer"))
    assert decoder_blocks(reformer) and all(map(recomputed_in_backward, decoder_blocks(reformer)))
    assert shared_modules(decoder_blocks(reformer)) == []


def test_a_misfit_keeps_only_itself_whole(tmp_path):
    """RWKV's feed-forward multiplies its receptance (column-parallel at first, a misfit: added to the whole
    residual stream) into its value's row-parallel output: that value is no adapter beside a split output
    (``latent.py``), so its key stays no latent and both stay split; only the receptance is kept whole (issue
    #27: the first misfit rule had kept all three whole in every block)."""
    from families import write_tiny_config

    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model

    plan = infer_plan(build_meta_model(write_tiny_config(str(tmp_path / "rwkv"), "rwkv")), 2)
    assert sorted(plan.replicated) == [f"rwkv.blocks.{b}.feed_forward.receptance" for b in (0, 1)]
    for b in (0, 1):
        ff = f"rwkv.blocks.{b}.feed_forward"
        assert (plan.styles[f"{ff}.key"], plan.styles[f"{ff}.value"]) == ("colwise", "rowwise")


def test_a_transposed_parameter_follows_along_the_dim_that_meets_the_channels():
    """Inkling 2's dynamic conv: taps stored [kernel, channels], transposed and viewed [heads, head_dim, kernel],
    added to per-token taps [.., heads, 1, kernel] split by heads: the taps follow along dim 1 (its channels),
    not dim 0 (the kernel), even where kernel and heads are both 4 (the tiny config's)."""
    import torch

    from shardlm.parallel.infer.tracker import ShardTracker

    tracker = ShardTracker()
    dynamic = torch.empty(1, 13, 16, device="meta")  # weight_proj's output: 4 heads x kernel 4
    tracker.mark(dynamic, frozenset({"weight_proj"}))
    tracker.layouts[id(dynamic)], tracker.widths["weight_proj"] = (-1, (16,)), 16
    taps = torch.nn.Parameter(torch.empty(4, 64, device="meta"))  # [kernel, 4 heads x head_dim 16]
    tracker.params = {id(taps): taps}
    with tracker:
        viewed = taps.float().T.view(4, -1, 4)
        _ = viewed + dynamic.view(1, 13, 4, 1, 4)
    assert tracker.param_dims[id(viewed)] == (1, 1, 0)  # heads and head_dim from the channels, then the kernel
    assert tracker.follows == {id(taps): (frozenset({"weight_proj"}), (64,))} and not tracker.violations
    assert tracker.follow_dims == {id(taps): 1}


def test_a_buffer_of_the_split_width_follows_its_linear_a_scalar_one_does_not():
    """Falcon-H1's ``mup_vector`` ([1, 1, width], multiplied into in_proj's output) follows in_proj's
    rows; a 0-dim buffer (Apertus's XIELU ``beta``) scales every channel alike and follows nothing."""
    import torch

    from shardlm.parallel.infer.tracker import ShardTracker

    tracker = ShardTracker()
    out = torch.empty(1, 13, 24, device="meta")
    tracker.mark(out, frozenset({"in_proj"}))
    tracker.layouts[id(out)], tracker.widths["in_proj"] = (-1, (24,)), 24
    beta, mup = torch.empty((), device="meta"), torch.empty(1, 1, 24, device="meta")
    tracker.buffers = {id(beta): "act.beta", id(mup): "mixer.mup_vector"}
    with tracker:
        _ = out * beta, out * mup
    assert tracker.buffer_follows == {"mixer.mup_vector": (frozenset({"in_proj"}), None)} and not tracker.violations


def test_fused_mamba_kernels_on_gpu_are_refused_before_spawning(tmp_path, monkeypatch):
    """With mamba_ssm on a CUDA machine, transformers' Mamba and Mamba-2 mixers train through fused
    kernels that take ``x_proj``'s and ``out_proj``'s weights themselves, bypassing their split: a
    split mixer is refused by name before any process starts (and in ``parallelize``); Gated DeltaNet's
    kernels take activations and the conv weight, which the mixer sees as local views: not refused.
    No GPU here: the kernels' availability and the device are patched."""
    import helpers

    from shardlm import ConfigError, preflight
    from shardlm.parallel.infer import channels

    def train_config(*args, **kwargs):  # recurrent mixers refuse document packing (test_packing.py)
        cfg = helpers.train_config(*args, **kwargs)
        cfg.data.packing_strategy = "wrapped"
        return cfg

    monkeypatch.setattr(channels, "weight_kernels_available", lambda: True)
    monkeypatch.setattr(preflight, "device_type", lambda: "cuda")
    for name, kernel in (("mamba", "mamba_inner_fn"), ("mamba2", "split_conv1d_scan_combined"), ("qwen3_5_text", "")):
        cfg = train_config(write_tiny_dir(str(tmp_path / name), name), {"tp": 2}, 1, 1, 1, output_dir=str(tmp_path))
        if kernel:
            with pytest.raises(ConfigError, match=f"mixer .* would train through the fused kernel {kernel}"):
                preflight.check_run(cfg)
        else:
            preflight.check_run(cfg)
    cfg = train_config(str(tmp_path / "mamba"), {"fsdp": 2}, 1, 1, 1, output_dir=str(tmp_path))
    preflight.check_run(cfg)  # not split: the kernel computes the whole mixer
    monkeypatch.setattr(channels, "weight_kernels_available", lambda: False)
    preflight.check_run(train_config(str(tmp_path / "mamba"), {"tp": 2}, 1, 1, 1, output_dir=str(tmp_path)))
