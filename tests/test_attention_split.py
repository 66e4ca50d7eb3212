"""Attention split by heads where per-head tensors act on the scores: they follow the heads.

gpt-oss appends its per-head ``sinks`` parameter to each head's scores before the softmax
(``parallel/infer/follow.py``: a tensor concatenated beside split activations at their heads'
size follows them, ``per_channel``, each rank holding its heads' sinks); Granite-SWA subtracts its
``sinks`` from each head's ``logsumexp`` of the scores (``layouts.py`` follows the heads through a
reduction of a later dim). Multi-query attention
(Falcon before its new decoder architecture, GPT-BigCode): the queries split, the one k/v head
computed by every rank (``Plan.sliced``). ALiBi (BLOOM, MPT): the bias the model builds from the
config's head count and hands to each attention is sliced to the rank's heads at their global
index (``Plan.head_inputs``, ``parallel/infer/head_inputs.py``, ``parallel/plan/head_inputs.py``);
so are MiniMax's per-head slopes and decays, buffers of its lightning attention.
DiffLlama (differential attention): head h paired with head h + heads/2, V cut in two along its kv
heads, so q, k and v are packed in two halves (``parts.record_heads_cut``), and the one scalar lambda
made from its parameters, whole on every rank, has its gradient summed over TP (``infer/broadcast.py``).
CodeGen's qkv, fused in the checkpoint's ``mp_num`` groups of [q, v, k]: each rank views its
contiguous columns into whole groups (``dry_run.py``) where tp divides them. DBRX (multi-query by
default: ``attn_config.kv_n_heads=1``) cuts its fused Wqkv by ``split([hidden, kv * d, kv * d])``: q
split, the k/v head computed by every rank, as Falcon's. Laguna: per-layer head counts and a per-head
gate, split like any attention once its tiny config's head counts agree (``scripts/tiny.py``).
DeepSeek-V3.2's sparse-attention indexer: its query heads (``wq_b``, ``weights_proj``) split with the
attention's, its one key head (``wk``) computed by every rank, each rank's sum of its heads' scores
all-reduced before the top-k (``parallel/infer/indexer.py``, ``parallel/runtime/indexer.py``); its
``index_topk`` set to 4 of the 16 tokens so the top-k picks (2048, the default, keeps every token).

Tiny models from each type's own config defaults (``scripts/tiny.py``, dropout off). Reference: the
plain transformers loop of ``helpers.plain_reference`` (one process, fp32), 5 steps; tolerances of
the issue: loss 1e-5 and grad_norm 1e-4 relative. Per rank, the attention's parameter bytes are
compared with 1/tp of the whole (what stays whole on every rank said by name).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_parity, make_adapter, plain_reference, run_ranks, shardlm_losses

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import tiny_config  # noqa: E402

# model type -> (the attention module of block 0, its linears split by heads)
SPLIT = {
    "gpt_oss": ("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "falcon": ("transformer.h.0.self_attention", ("query_key_value", "dense")),
    "gpt_bigcode": ("transformer.h.0.attn", ("c_attn", "c_proj")),
    "bloom": ("transformer.h.0.self_attention", ("query_key_value", "dense")),
    "mpt": ("transformer.blocks.0.attn", ("Wqkv", "out_proj")),
    "granite_swa": ("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "diffllama": ("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "codegen": ("transformer.h.0.attn", ("qkv_proj", "out_proj")),
    # block 1: lightning attention (block 0 is softmax attention)
    "minimax": ("model.layers.1.self_attn", ("qkv_proj", "output_gate", "out_proj")),
    # multi-query (attn_config.kv_n_heads=1), its fused Wqkv cut by split([hidden, kv * d, kv * d])
    "dbrx": ("transformer.blocks.0.norm_attn_norm.attn", ("Wqkv", "out_proj")),
    # per-layer head counts (num_attention_heads_per_layer) and a softplus gate per head (g_proj)
    "laguna": ("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")),
}
# DSA: the indexer of block 0, its linears split by its query heads (its one key head ``wk`` kept whole)
INDEXED = {"deepseek_v32": ("model.layers.0.self_attn.indexer", ("wq_b", "weights_proj"))}
CONFIG = {"deepseek_v32": {"index_topk": 4}}  # of 16 tokens: the top-k picks (the default 2048 keeps all)
WORLD = {**SPLIT, **INDEXED}  # the types trained in the tp=2 worlds
# planned only (their tp=2 parity is the matrix's rows): the attention of block 1, its linears split by heads
PLANNED = {
    # GLM-DSA's attention with a gate and sinks: it returns its indexer's top-k (no gradient), no leak of the q
    # latent (as GLM-DSA's), heads split; its MLA widths not taken for split ones (q_a_proj, a latent, is whole)
    "hy_v4": ("model.layers.1.self_attn", ("q_b_proj", "kv_b_proj", "gate_proj", "o_proj")),
    # one shared key=value head read by every query head, whole with its compressor on every rank; the grouped
    # o_a_proj by whole groups of heads (``infer/shared_kv.py``)
    "deepseek_v4": ("model.layers.1.self_attn", ("q_b_proj", "o_b_proj")),
    # sliding layers with twice the config's kv heads: each rank repeats its kv heads by its own groups
    "mimo_v2_flash": ("model.layers.1.self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    # a forget gate adding dt_bias viewed [1, 1, heads, head_dim]: dt_bias follows the heads
    "bailing_hybrid": ("model.layers.1.self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    # a bank of relative-logit profiles [d_rel, extent] applied within each head: gradients summed over TP
    "inkling_text": ("model.layers.1.self_attn", ("q_proj", "k_proj", "v_proj", "r_proj", "o_proj")),
    # the full-attention layer 2: an L2 clip scaling each head's channels ([heads, head_dim], follows the heads), the
    # bank multiplied within each head (its gradient summed over TP), and keys and values convolved per kv head by
    # taps of static [kernel, channels] (split along dim 1, with the heads) plus per-token ones (weight_proj, colwise);
    # the sliding layers 0 and 1 alike but for the conv (depthwise, ``conv1d``); nothing kept replicated
    "inkling2_text": (
        "model.layers.2.self_attn",
        (
            "q_proj.linear",
            "k_proj.linear",
            "k_proj.sconv.weight_proj",
            "v_proj.linear",
            "v_proj.sconv.weight_proj",
            "o_proj.gate_proj",
            "sink_proj",
            "relative_position_bias.linear",
            "o_proj.linear",
        ),
    ),
    # CCA: cat(q, k) convolved depthwise then per head (the convs follow the heads, their groups local), a key
    # temperature per kv head; its value, cat(v_proj_current, v_proj_delayed) viewed into kv heads, sliced per rank
    "zaya": (
        "model.layers.1.self_attn",
        ("qkv_proj.q_proj", "qkv_proj.k_proj", "qkv_proj.v_proj_current", "qkv_proj.v_proj_delayed", "o_proj"),
    ),
    # BLT: each stack's attention reads its own sub-config's head count (the top-level config names none); its
    # patcher's too: only its tail (entropies -> patch lengths, after its logits) runs whole (``infer/probe.py``)
    "blt": ("model.global_transformer.layers.1.self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    # Reformer's LSH layer: buckets and offsets made at the local head count, its rotations drawn per rank's heads
    "reformer": (
        "reformer.encoder.layers.1.attention",
        ("self_attention.query_key", "self_attention.value", "output.dense"),
    ),
    # the output reshaped to the embed_dim of its input's size(): each rank to its share
    "trocr": ("model.decoder.layers.1.self_attn", ("q_proj", "k_proj", "v_proj", "out_proj")),
    # its forward swaps in a BigBirdSelfAttention built from the whole config below its block-sparse length:
    # localized when its parent runs (``plan/local_geometry.localize_rebuilt``)
    "big_bird": ("bert.encoder.layer.1.attention", ("self.query", "self.key", "self.value", "output.dense")),
    # no linear: einsums of per-head parameters [d_model, heads, head_dim], read like column-parallel linears (q, k,
    # v, r) and summed over the heads like a row-parallel one (o), its biases with the heads (``infer/head_einsums``)
    "xlnet": ("transformer.layer.1.rel_attn", ("q", "k", "v", "r", "o")),
    # the indexed_attention layer 2: its QSA indexer's fused index_qk_proj [4 query heads | 1 key head] x 16 packed,
    # the query heads split, the key head whole on every rank, scores summed over TP before the top-k over blocks
    "qwen4_exp_text": ("model.layers.2.self_attn", ("q_proj", "k_proj", "v_proj", "indexer.index_qk_proj", "o_proj")),
}
# per model type: the attention's parameter elements, whole, and held by each rank at tp=2
ATTENTION_ELEMENTS = {
    # q/k/v [64, 64] + bias, o [64, 64], sinks [4]: halved; o's bias [64] whole (added after the all-reduce)
    "gpt_oss": (16644, 8354),
    # multi-query: the fused [q 64 | k 16 | v 16] x 64 stored whole on every rank (``Plan.sliced``: each
    # computes its half of q and the one k/v head), the output projection [64, 64] halved
    "falcon": (10240, 8192),
    # the same with biases, c_proj's [64] whole (added after the all-reduce)
    "gpt_bigcode": (10400, 8352),
    # ALiBi: no parameter per head (the slopes are built in the forward); dense's bias [64] whole
    "bloom": (16640, 8352),
    "mpt": (16384, 8192),
    # q/k/v/o [64, 64], sinks [4] (sigmoid(logsumexp(scores) - sink) scales each head's output): halved
    "granite_swa": (16388, 8194),
    # q/k/v/o [64, 64] halved; the lambdas (4 x [16], one scalar for every head) whole on every rank
    "diffllama": (16448, 8256),
    # qkv [192, 64] in 4 groups of [q, v, k] (each rank its 2 whole groups), out [64, 64]: halved
    "codegen": (16384, 8192),
    # qkv [192, 64], output_gate and out [64, 64], its norm [64]: halved (the slopes and decays are buffers)
    "minimax": (20544, 10272),
    # multi-query as Falcon: Wqkv [64 | 16 | 16] x 64 stored whole, out_proj [64, 64] halved
    "dbrx": (10240, 8192),
    # q/k/v/o [64, 64] and g_proj [4, 64] halved; q_norm and k_norm [16] (per head) whole
    "laguna": (16672, 8352),
    # MLA: q_a_proj [32, 64] and kv_a_proj_with_mqa [40, 64] (latents) whole, their norms whole, q_b_proj
    # [96, 32], kv_b_proj [128, 32], o_proj [64, 64] halved; the indexer's wq_b [64, 32] and weights_proj
    # [4, 64] halved, wk [16, 64] (its one key head) and k_norm [16] + bias whole
    "deepseek_v32": (19296, 12512),
}
# the attention's fp32 bytes (per rank, whole) over both blocks where they differ: MiniMax's block 0 is
# softmax attention (q/k/v/o [64, 64])
ATTENTION_BYTES = {"minimax": (4 * (10272 + 8192), 4 * (20544 + 16384))}
# DBRX's DbrxNormAttentionNorm (its two norms around the attention) is no attention class (``kept_whole._ATTENTION``):
# its DbrxAttention alone is counted


def _write(root: Path, model_type: str) -> str:
    path = root / model_type
    config = tiny_config(model_type)
    for key, value in CONFIG.get(model_type, {}).items():
        setattr(config, key, value)
    config.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention")
    return {t: _write(root, t) for t in {**WORLD, **PLANNED}}


def test_attention_is_split_with_what_acts_per_head(dirs):
    """The plan splits the attention's linears and places the per-head tensors with the heads."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model

    for model_type, (attention, linears) in SPLIT.items():
        plan = infer_plan(build_meta_model(dirs[model_type]), 2)
        every = re.sub(r"\.\d+\.", ".*.", attention)  # the attention of every block
        kept = [f for f in plan.replicated if re.sub(r"\.\d+\.", ".*.", f).startswith(every)]
        assert not [f for f in kept if not f.endswith(".indexer.wk")], plan.replicated  # DSA's one key head only
        styles = [plan.styles[f"{attention}.{name}"] for name in linears]
        assert styles[-1] == "rowwise" and all(s.endswith("colwise") for s in styles[:-1]), (model_type, styles)
    for model_type in ("gpt_oss", "granite_swa"):
        plan = infer_plan(build_meta_model(dirs[model_type]), 2)
        attention = SPLIT[model_type][0]
        assert plan.styles[attention] == "per_channel"  # the sinks, one per head: each rank its heads'
        assert set(plan.channels[attention]) == {"sinks"}
        assert plan.experts[attention]["sinks"].dim == 0
    # ALiBi built in the model from the config's head count, handed to each attention: its heads' rows
    for model_type, name in (("bloom", "alibi"), ("mpt", "position_bias")):
        plan = infer_plan(build_meta_model(dirs[model_type]), 2)
        assert plan.head_inputs[SPLIT[model_type][0]] == {name: 0}, (model_type, plan.head_inputs)
    # MiniMax's lightning attention: its per-head slopes and decays are buffers built in its __init__ from
    # the config's head count; each rank's heads of them while it runs; its recurrent state, zeros sized by
    # num_attention_heads, made at the rank's own head count (``localize_geometry``)
    plan = infer_plan(build_meta_model(dirs["minimax"]), 2)
    decays = {"self.slope_rate": 0, "self.query_decay": 0, "self.key_decay": 0, "self.diagonal_decay": 1}
    assert plan.head_inputs == {"model.layers.1.self_attn": decays}, plan.head_inputs
    # DiffLlama pairs head h with head h + heads/2 (its attention output chunked in two along the heads)
    # and splits V in two along the kv heads: q, k and v each packed in two halves, split 2 ways, so a
    # rank holds both heads of its pairs; its scalar lambda, whole, has its gradient summed over TP
    plan = infer_plan(build_meta_model(dirs["diffllama"]), 2)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert plan.parts[f"model.layers.0.self_attn.{name}"] == [32, 32], name
    assert plan.styles["model.layers.0.self_attn"] == "replicate_own"
    assert [p for p in plan.partial_grads if ".layers.0." in p] == [
        f"model.layers.0.self_attn.lambda_{n}" for n in ("k1", "k2", "q1", "q2")
    ]
    # CodeGen: qkv viewed into mp_num=4 groups of [q, v, k] (the checkpoint's), sized by its embed_dim: kept
    # whole on each rank (``Plan.local_sizes``) so its contiguous columns view into 4/tp whole groups
    for tp in (2, 4):
        plan = infer_plan(build_meta_model(dirs["codegen"]), tp)
        assert plan.styles["transformer.h.0.attn.qkv_proj"] == "colwise" and not plan.replicated, tp
        assert plan.local_sizes["transformer.h.0.attn"] == {"embed_dim": 64}, tp
    # multi-query: q split, the one k/v head computed by every rank (rows of the fused projection)
    for model_type in ("falcon", "gpt_bigcode", "dbrx"):
        plan = infer_plan(build_meta_model(dirs[model_type]), 2)
        attention, (fused, _) = SPLIT[model_type]
        assert plan.parts[f"{attention}.{fused}"] == [64, 16, 16], model_type
        assert plan.sliced[f"{attention}.{fused}"] == [[(0, 32), (64, 80), (80, 96)], [(32, 64), (64, 80), (80, 96)]]


def test_norms_scales_and_biases_of_the_heads_follow_them(tmp_path):
    """Dory (nGPT): its parameter-free L2 norms across the split attention output and MLP width are
    ``sharded_norm`` (the sum of squares all-reduced), ``sqk`` (one flat vector viewed into [heads, 1,
    head_dim]) and ``s_gate`` follow the heads, its LM head's per-token ``logit_scale`` is split by
    vocabulary with the weight (a probe checked it acts per column: ``infer/vocab_head.py``). CPM-Ant:
    the position bias it looks up once in a parameter table and hands to every block is sliced to each
    rank's heads, the table's gradient summed over TP (``infer/head_inputs.py``). Doge: its dt_proj's
    output narrowed to each rank's kv heads (``infer/narrowed.py``). XLNet: its per-head parameters split by
    heads, the biases [heads, head_dim] and segment table [2, heads, head_dim] too, nothing kept whole.
    Plans only: their parity is the matrix's rows."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.kept_whole import kept_whole
    from shardlm.parallel.plan.styles import sharded_dim

    for model_type in ("dory", "cpmant"):
        tiny_config(model_type).save_pretrained(tmp_path / model_type)
    meta = build_meta_model(str(tmp_path / "dory"))
    plan = infer_plan(meta, 2)
    attention, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert not plan.replicated and plan.styles[f"{attention}.o_proj"] == "rowwise"
    assert plan.styles[f"{attention}.attn_sub_norm"] == plan.styles[f"{mlp}.ffn_sub_norm"] == "sharded_norm"
    assert f"{attention}.q_norm" not in plan.styles  # per head: within each rank's heads
    assert set(plan.channels[attention]) == {"sqk", "s_gate"} and plan.experts[attention]["sqk"].dim == 0
    assert sharded_dim(plan.styles["lm_head"], meta.lm_head, "logit_scale") == 0
    plan = infer_plan(build_meta_model(str(tmp_path / "cpmant")), 2)
    attention = "cpmant.encoder.layers.0.self_att.self_attention"
    assert not plan.replicated and plan.head_inputs[attention] == {3: 1}, plan.head_inputs
    assert plan.partial_grads == ["cpmant.position_bias.relative_attention_bias"]
    # Doge: dt_proj, row-parallel, gives one value per kv head to its dynamic mask: each rank its heads' columns
    tiny_config("doge").save_pretrained(tmp_path / "doge")
    plan = infer_plan(build_meta_model(str(tmp_path / "doge")), 2)
    assert not plan.replicated and plan.narrowed == [f"model.layers.{i}.self_attn.dt_proj" for i in range(2)]
    assert plan.channels["model.layers.0.self_attn"] == {"A": "model.layers.0.self_attn.dt_proj"}
    # XLNet's attention: einsums of parameters of its own, no linear layer: split by heads (``infer/head_einsums.py``)
    tiny_config("xlnet").save_pretrained(tmp_path / "xlnet")
    meta = build_meta_model(str(tmp_path / "xlnet"))
    plan = infer_plan(meta, 2)
    attention = "transformer.layer.0.rel_attn"
    assert plan.styles[attention] == "per_channel" and not plan.replicated and kept_whole(plan, meta) == []
    dims = {name: placed.dim for name, placed in plan.experts[attention].items()}
    assert dims == {**dict.fromkeys("qkvor", 1), "r_r_bias": 0, "r_s_bias": 0, "r_w_bias": 0, "seg_embed": 1}
    assert plan.head_einsums[attention] == {**dict.fromkeys("qkvr", "reads_whole"), "o": "sums_heads"}


@pytest.mark.sweep
def test_attention_split_in_the_planned_types(dirs):
    """``PLANNED``'s types (their parity is the matrix's rows): block 1's attention split, nothing of it kept
    whole but a DSA indexer's one key head, and what acts per head placed with the heads (17 s under load: in
    ``make test``, not the fast tier)."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.kept_whole import attention_bytes

    plans = {t: infer_plan(build_meta_model(dirs[t]), 2) for t in PLANNED}
    for model_type, (attention, linears) in PLANNED.items():
        plan = plans[model_type]  # its block 1 only (other kinds of blocks may stay whole)
        kept = [f for f in plan.replicated if f.startswith(attention)]
        assert not [f for f in kept if not f.endswith(".indexer.wk")], plan.replicated
        if attention in plan.head_einsums:  # its parameters, by the einsums reading them
            roles = [plan.head_einsums[attention][name] for name in linears]
            assert roles[-1] == "sums_heads" and set(roles[:-1]) == {"reads_whole"}, (model_type, roles)
            continue
        styles = [plan.styles[f"{attention}.{name}"] for name in linears]
        assert styles[-1] == "rowwise" and all(s.endswith("colwise") for s in styles[:-1]), (model_type, styles)
    assert plans["bailing_hybrid"].styles["model.layers.1.self_attn.forget_gate"] == "per_channel"
    assert set(plans["bailing_hybrid"].channels["model.layers.1.self_attn.forget_gate"]) == {"A_log", "dt_bias"}
    assert plans["inkling_text"].styles["model.layers.1.self_attn.rel_logits_proj"] == "replicate_grad_allreduce"
    assert "model.layers.1.self_attn.relative_position_bias.proj" in plans["inkling2_text"].partial_grads
    assert plans["inkling2_text"].styles["model.layers.1.self_attn.q_proj.norm"] == "per_channel"
    inkling2, sconv = plans["inkling2_text"], "model.layers.2.self_attn.k_proj.sconv"
    assert not inkling2.replicated and inkling2.styles[sconv] == "per_channel"
    assert inkling2.channel_dims[f"{sconv}.static_weight"] == 1 and inkling2.experts[sconv]["static_weight"].dim == 1
    assert inkling2.local_sizes[sconv] == {"num_heads": 2}  # of 4 kv heads; conv_kernel_size (also 4) whole
    assert "model.layers.2.self_attn.v_proj.norm" not in inkling2.styles  # per head (head_dim 16), not the width
    zaya = plans["zaya"]
    assert zaya.local_sizes["model.layers.1.self_attn.qkv_proj.conv_qk_grouped"] == {"groups": 3}  # of 6 heads
    # its value, cat(v_proj_current, v_proj_delayed) viewed into 2 kv heads: rank 0 stores and computes all of the
    # first, rank 1 all of the second (``shards.RowsShard``); stored whole on both, the attention was 0.565 a rank
    assert zaya.stored_rows["model.layers.1.self_attn.qkv_proj.v_proj_current"] == [[(0, 16)], [(0, 0)]]
    assert zaya.stored_rows["model.layers.1.self_attn.qkv_proj.v_proj_delayed"] == [[(0, 0)], [(0, 16)]]
    assert not zaya.sliced
    # per block: q/o [64, 64], k [32, 64], the value's two [16, 64], the convs' [96, 1, 2] and [96, 16, 2] + biases,
    # qk_norm's temp [2]: 15746 elements, 7873 on each rank (0.500)
    assert attention_bytes(build_meta_model(dirs["zaya"]), zaya, 2) == (2 * 4 * 7873, 2 * 4 * 15746)
    assert zaya.styles["model.layers.1.self_attn.qk_norm"] == "per_channel"
    assert plans["blt"].styles["model.local_decoder.cross_attn_layers.1.q_proj"] == "colwise"
    patcher = {f: plans["blt"].styles[f"model.patcher.layers.0.{f}"] for f in ("self_attn.o_proj", "mlp.up_proj")}
    assert patcher == {"self_attn.o_proj": "rowwise", "mlp.up_proj": "colwise"} and not plans["blt"].replicated
    assert 0 in plans["reformer"].dropout_sites  # the rotations randn(heads, ...): sharded along the heads
    assert plans["trocr"].local_reshapes["model.decoder.layers.1.self_attn"] == 64
    qwen4, qsa = plans["qwen4_exp_text"], "model.layers.2.self_attn.indexer"
    assert qwen4.indexers == {qsa: 1.0} and qwen4.local_sizes[qsa] == {"index_n_heads": 2}  # plain sums: factor 1
    fused = f"{qsa}.index_qk_proj"
    assert qwen4.parts[fused] == [64, 16] and qwen4.whole_parts[fused] == [False, True]
    assert qwen4.sliced[fused] == [[(0, 32), (64, 80)], [(32, 64), (64, 80)]]  # its query heads' rows and the key's


@pytest.mark.sweep  # a plan and a CPU model: 0.6 s idle, out of the fast tier
def test_big_bird_attention_rebuilt_is_localized_and_block_sparse_training_refused(tmp_path):
    """BigBird's forward, below its block-sparse length ((5 + 2 * num_random_blocks) * block_size tokens), swaps in
    a ``BigBirdSelfAttention`` built from the whole config: localized before it runs (a pre-hook on its parent,
    ``plan/local_geometry.localize_rebuilt``). Above that length its block-sparse attention draws random key
    blocks for all heads from one stream, heads interleaved, in training: refused at tp > 1, one line, before spawning
    where data.seq_len is above that length, and at run time."""
    from transformers import AutoModelForCausalLM

    from shardlm.errors import ConfigError
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.local_geometry import localize_geometry

    config = tiny_config("big_bird")
    config.block_size, config.num_random_blocks = 4, 1  # block-sparse above 28 tokens
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)  # on the CPU: the hook runs before any split linear would
    localize_geometry(model, infer_plan(build_meta_model(str(tmp_path)), 2), 2)
    attention = model.bert.encoder.layer[0].attention
    assert attention.self.num_attention_heads == 2  # the block-sparse attention built with the model
    model.bert.set_attention_type("original_full")  # what its forward does below 28 tokens
    assert attention.self.num_attention_heads == 4
    for hook in attention._forward_pre_hooks.values():
        hook(attention, ())
    assert (attention.self.num_attention_heads, attention.self.all_head_size) == (2, 32)
    model.bert.set_attention_type("block_sparse")
    model.train()
    with pytest.raises(ConfigError, match=r"^parallel.tp: bert.encoder.layer.0.attention.self .* random key blocks"):
        model(input_ids=torch.zeros((1, 32), dtype=torch.long))
    # and before spawning, where data.seq_len is above that length (the run-time check stays as the net for a
    # model trained outside shardlm's trainer)
    from helpers import load_checked

    (tmp_path / "data.txt").write_text("hello world\n")
    raw = {"model": str(tmp_path), "data": {"path": str(tmp_path / "data.txt"), "seq_len": 32}, "parallel": {"tp": 2}}
    with pytest.raises(ConfigError, match=r"^data.seq_len=32: parallel.tp: .* up to 28 tokens") as info:
        load_checked(raw=raw)
    assert "\n" not in str(info.value)


def test_codegen_groups_tp_does_not_divide_are_named(tmp_path):
    """tp=8 on a CodeGen of 8 heads: its 4 qkv groups cannot each be whole on a rank, so its attention
    is kept replicated with the groups named (the MLP still split)."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model

    config = tiny_config("codegen")
    config.n_head = 8
    config.save_pretrained(tmp_path / "codegen8")
    plan = infer_plan(build_meta_model(str(tmp_path / "codegen8")), 8)
    why = plan.replicated["transformer.h.0.attn.qkv_proj"]
    assert why.endswith("is fused in 4 groups of 48 columns fixed by the checkpoint, which tp=8 does not divide"), why
    assert plan.styles["transformer.h.0.mlp.fc_in"] == "colwise"


def test_indexer_heads_split_with_the_attention(dirs):
    """DSA's indexer: wq_b and weights_proj split by its query heads (2 of 4 per rank), wk (one key head)
    kept whole with that said, the attention's bytes per rank 12512 of 19296 elements per block (0.648;
    0.708 with the indexer whole)."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.kept_whole import attention_bytes, kept_whole

    meta = build_meta_model(dirs["deepseek_v32"])
    plan = infer_plan(meta, 2)
    indexer, linears = INDEXED["deepseek_v32"]
    assert [plan.styles[f"{indexer}.{name}"] for name in linears] == ["colwise", "colwise"]
    assert plan.indexers[indexer] == 2**-0.5 and plan.local_sizes[indexer] == {"n_heads": 2}  # 4 ** -0.5 / 2 ** -0.5
    assert plan.styles["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert [f for f in plan.replicated if ".layers.0." in f] == [f"{indexer}.wk"]
    assert kept_whole(plan)[0] == (
        "model.layers.*.self_attn.indexer.wk: replicated (the indexer's one key head, read by all its query heads)"
    )
    whole, local = ATTENTION_ELEMENTS["deepseek_v32"]
    assert attention_bytes(meta, plan, 2) == (3 * 4 * local, 3 * 4 * whole)


def test_kept_whole_names_what_each_rank_stores_whole(dirs):
    """The matrix's "kept whole" column (``plan/kept_whole.py``): the attention's fp32 bytes per rank
    against the whole (the two blocks of ``ATTENTION_ELEMENTS``), and what is stored whole and why."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.kept_whole import attention_bytes, kept_whole

    for model_type in SPLIT:
        meta = build_meta_model(dirs[model_type])
        plan = infer_plan(meta, 2)
        whole, local = ATTENTION_ELEMENTS[model_type]
        expected = ATTENTION_BYTES.get(model_type, (2 * 4 * local, 2 * 4 * whole))
        assert attention_bytes(meta, plan, 2) == expected, model_type
        mqa = [f"{SPLIT[model_type][0].replace('.0.', '.*.')}.{SPLIT[model_type][1][0]}: stored whole (1 kv head(s)"]
        expect = mqa if model_type in ("falcon", "gpt_bigcode", "dbrx") else []
        if model_type == "dbrx":  # its router, hidden -> 4 experts, softmaxed whole
            expect = ["transformer.blocks.*.ffn.router.layer: replicated (softmax over the split width 4)", *mqa]
        if model_type == "diffllama":
            expect = ["model.layers.*.self_attn.lambda_k1, model.layers.*.self_attn.lambda_k2, "]
        kept = kept_whole(plan)
        assert len(kept) == len(expect) and [w[: len(e)] for w, e in zip(kept, expect)] == expect, (model_type, kept)
    meta = build_meta_model(dirs["gpt_oss"])
    plan = infer_plan(meta, 2)
    plan.replicated = {"model.layers.0.self_attn.q_proj": "why", "model.layers.1.self_attn.q_proj": "why"}
    assert kept_whole(plan) == ["model.layers.*.self_attn.q_proj: replicated (why)"]


def test_cross_attention_never_run_is_split_like_self_attention(tmp_path):
    """Whisper's decoder-only class: its cross-attention (``encoder_attn``) never runs on text rows (no encoder
    states), so no trace places it; it is split by heads as the self-attention of its class is
    (``infer/unrun.split_like``): the same styles, the same bytes per rank, nothing listed as kept whole."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.describe import describe_plan
    from shardlm.parallel.plan.kept_whole import kept_whole

    tiny_config("whisper").save_pretrained(tmp_path)
    meta = build_meta_model(str(tmp_path))
    plan = infer_plan(meta, 2)
    layer = "model.decoder.layers.0"
    assert f"{layer}.encoder_attn" in plan.unrun and f"{layer}.encoder_attn" in plan.attention
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert plan.styles[f"{layer}.encoder_attn.{name}"] == plan.styles[f"{layer}.self_attn.{name}"], name
    rows = describe_plan(meta, plan, 2)
    per_rank = {
        a: sum(r["bytes_per_rank"] for r in rows if r["module"].startswith(f"{layer}.{a}."))
        for a in ("self_attn", "encoder_attn")
    }
    assert per_rank["encoder_attn"] == per_rank["self_attn"] < 4 * 4 * 64 * 64 / 2 + 4 * 4 * 64, per_rank
    assert kept_whole(plan, meta) == []


# model type -> (what its plan keeps whole at tp=2, the property of the model's code said for it)
KEPT_FOR_A_PROPERTY = {
    "glm_moe_dsa": ("model.layers.*.self_attn.indexer.wk", "the indexer's one key head, read by all its query"),
    "prophetnet": ("prophetnet.decoder.layers.*.self_attn.key_proj", "the predicting streams' bias pairs each head"),
    "gemma4": ("model.language_model.layers.*.per_layer_input_gate", "per_layer_input (whole, with gradients)"),
}


@pytest.mark.sweep
def test_kept_whole_says_the_models_property(tmp_path):
    """Where the trace's reason is only the symptom (a shape error at one rank's shapes, a per-head
    tensor), the kept-whole line says the property of the model's code (``infer/properties.py``)."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.kept_whole import kept_whole

    for model_type, (module, why) in KEPT_FOR_A_PROPERTY.items():
        tiny_config(model_type).save_pretrained(tmp_path / model_type)
        kept = kept_whole(infer_plan(build_meta_model(str(tmp_path / model_type)), 2))
        lines = [w for w in kept if module in w.split(": replicated (")[0]]
        assert len(lines) == 1 and lines[0].split(": replicated (")[1].startswith(why), (model_type, kept)


@pytest.mark.sweep  # 4 s of planning: out of the fast tier
def test_gemma3n_attention_split_in_every_layer(tmp_path):
    """Gemma 3n's AltUp projections of the embedding, split, split the residual stream every layer reads:
    the trace's first pairings are its echoes (q/k/v row-parallel, o_proj column-parallel), which wait
    while their cause is kept whole; a leaked latent (AltUp's router) is kept whole with its up-projection
    in every layer. Attention and LAuReL are then split in every layer, and what is kept whole says the
    model's property (activation sparsity's statistics, AltUp's magnitudes), not a symptom."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.infer.properties import PROPERTIES
    from shardlm.parallel.model.meta import build_meta_model

    config = tiny_config("gemma3n_text")
    config.save_pretrained(tmp_path)
    plan = infer_plan(build_meta_model(str(tmp_path)), 2)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        assert plan.styles[f"{layer}.self_attn.q_proj"] == plan.styles[f"{layer}.laurel.linear_left"] == "colwise"
        assert plan.styles[f"{layer}.self_attn.o_proj"] == plan.styles[f"{layer}.laurel.linear_right"] == "rowwise"
        sparse = config.activation_sparsity_pattern[i] > 0
        assert (plan.styles[f"{layer}.mlp.down_proj"] == "rowwise") != sparse, layer
        if sparse:
            assert plan.replicated[f"{layer}.mlp.gate_proj"] == PROPERTIES["Gemma3nTextMLP"]
    assert plan.replicated["model.altup_projections.0"] == PROPERTIES["Gemma3nTextModel.altup_projections.0"]


@pytest.mark.sweep  # 2.5 s of planning idle: out of the fast tier, in make test
def test_parameters_read_directly_around_split_layers_are_kept_whole(tmp_path):
    """ProphetNet's decoder, whose feed-forwards are split, reads its position and n-gram tables itself
    (``position_embeddings._forward``, ``ngram_embeddings.weight[i]``): the tables are kept whole, served
    to it as local views while it runs (``Plan.direct_reads``, ``infer/direct_reads.py``), said in the
    kept-whole column with the model's property; the plan refused it before."""
    from shardlm.parallel.infer.autotp import infer_plan
    from shardlm.parallel.infer.properties import PROPERTIES
    from shardlm.parallel.model.meta import build_meta_model
    from shardlm.parallel.plan.kept_whole import kept_whole

    tiny_config("prophetnet").save_pretrained(tmp_path)
    plan = infer_plan(build_meta_model(str(tmp_path)), 2)
    tables = ("prophetnet.decoder.position_embeddings", "prophetnet.decoder.ngram_embeddings")
    why = PROPERTIES["ProphetNetDecoder.position_embeddings"]
    assert plan.direct_reads == dict.fromkeys(tables, ("prophetnet.decoder", why))
    assert {plan.styles[t] for t in tables} == {"replicate_local"}
    ffn = "prophetnet.decoder.layers.0.feed_forward"
    assert (plan.styles[f"{ffn}.intermediate"], plan.styles[f"{ffn}.output"]) == ("colwise", "rowwise")
    assert f"{', '.join(tables)}: stored whole ({why})" in kept_whole(plan)


def attention_elements(paths: dict[str, str]) -> dict[str, tuple[int, int]]:
    """Rank body: per model path, the elements of the parameters under its block-0 attention
    (``paths[path]``) in all and on this rank, at tp=2."""
    from shardlm import build_mesh, init_distributed, parallelize
    from shardlm.config import ParallelConfig

    init_distributed()
    mesh = build_mesh(ParallelConfig(tp=2))
    out = {}
    for path, under in paths.items():
        params = [p for n, p in parallelize(path, mesh).module.named_parameters() if n.startswith(f"{under}.")]
        out[path] = (sum(p.numel() for p in params), sum(p.to_local().numel() for p in params))
    return out


def tp2_body(paths: list[str], attention: dict[str, str]) -> tuple[dict, dict]:
    return shardlm_losses(paths, {"tp": 2}, 4, 1), attention_elements(attention)


@pytest.mark.ranks
def test_tp2_matches_one_process_and_halves_the_attention(dirs):
    paths = [dirs[t] for t in WORLD]
    attention = {dirs[t]: under.rpartition(".indexer")[0] or under for t, (under, _) in WORLD.items()}
    losses, elements = run_ranks(tp2_body, 2, paths, attention)
    for model_type in WORLD:
        assert_parity(losses[dirs[model_type]], plain_reference(dirs[model_type], 4), label=model_type)
        assert elements[dirs[model_type]] == ATTENTION_ELEMENTS[model_type], (model_type, elements[dirs[model_type]])


@pytest.mark.ranks
def test_tp2_fsdp2_matches_one_process(dirs):
    paths = [dirs[t] for t in WORLD]
    losses = run_ranks(shardlm_losses, 4, paths, {"tp": 2, "fsdp": 2}, 2, 1)
    for model_type in WORLD:
        assert_parity(losses[dirs[model_type]], plain_reference(dirs[model_type], 4), label=f"{model_type} tp2xfsdp2")


@pytest.mark.ranks
def test_gpt_oss_lora_at_tp2_matches_one_process_peft(dirs, tmp_path):
    """LoRA on gpt-oss's split attention (the sinks frozen with the base) against one-process peft:
    losses, grad norms, every adapter tensor's step-1 gradient, and the exported adapter."""
    from safetensors.torch import load_file
    from test_lora import assert_same_grads, lora_rank, peft_reference

    from shardlm.checkpoint.export import consolidate

    path = dirs["gpt_oss"]
    adapter = make_adapter(path, str(tmp_path / "adapter"), ["q_proj", "k_proj", "v_proj", "o_proj"])
    got = run_ranks(lora_rank, 2, [(path, adapter)], {"tp": 2}, 4)[path]
    ref_steps, ref_adapter, ref_grads = peft_reference(path, adapter)
    assert_parity(got["steps"], ref_steps, label="gpt_oss LoRA tp2")
    assert_same_grads(got["grads"], ref_grads, "gpt_oss LoRA tp2")
    assert got["tp_same"]
    consolidate(str(Path(path) / "out"), str(tmp_path / "adapter-out"))
    ours = load_file(str(tmp_path / "adapter-out" / "adapter_model.safetensors"))
    assert ours.keys() == ref_adapter.keys()
    for key, value in ref_adapter.items():
        assert torch.allclose(ours[key], value, rtol=1e-4, atol=1e-6), key


# published defaults are dropout 0 for these types but for gpt-oss's and BLOOM's attention dropout (0.0
# too): turned on here, alone, against one process drawing the same masks (``plain_reference(dropout=True)``)
DROPOUT = {
    "gpt_oss": {"attention_dropout": 0.1},
    "bloom": {"attention_dropout": 0.1, "hidden_dropout": 0.1},
    # its published dropout (0.1), one module serving the split probabilities and the whole output (summed first)
    "xlnet": {"dropout": 0.1},
}


@pytest.mark.ranks
def test_dropout_on_split_attention_matches_one_process(tmp_path):
    """Attention dropout on the split scores (gpt-oss: after the sinks are dropped; BLOOM: with ALiBi,
    the bias sliced per rank) at tp=2: the one-process masks, TP replicas bit-identical."""
    from test_dropout import check_run, run_jobs

    paths = {}
    for model_type, overrides in DROPOUT.items():
        config = tiny_config(model_type)
        for key, value in overrides.items():
            setattr(config, key, value)
        config.save_pretrained(tmp_path / model_type)
        paths[model_type] = str(tmp_path / model_type)
    results = run_ranks(run_jobs, 2, [(path, "tp2") for path in paths.values()])
    for (model_type, path), result in zip(paths.items(), results):
        check_run(result, plain_reference(path, 4, dropout=True), f"tp2 {model_type} dropout")


def test_each_rank_sees_its_own_heads_of_alibi():
    """BLOOM's ALiBi bias, ``[batch * heads, 1, keys]``, sliced per rank (``own_heads``) is the bias of
    that rank's heads at their global index, batch by batch (the slopes differ per head)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from shardlm.parallel.plan.head_inputs import own_heads

    mask = torch.ones(3, 7)
    whole = build_alibi_tensor(mask, 8, torch.float32).view(3, 8, 1, 7)
    for rank in range(4):
        got = own_heads(whole.flatten(0, 1), 0, 8, 4, rank).view(3, 2, 1, 7)
        assert torch.equal(got, whole[:, 2 * rank : 2 * rank + 2]), rank
    assert not torch.equal(whole[:, 0], whole[:, 2])  # the first heads' slopes would not do


def test_layouts_follow_heads_beside_a_cat_and_through_a_reduction_of_a_later_dim():
    """gpt-oss's sinks appended to the scores along the keys, Granite-SWA's ``logsumexp`` over the keys:
    the heads stay the split dim; a tensor of another rank beside them (an empty kv cache) drops it."""
    from shardlm.parallel.infer.layouts import propagate

    layouts = {}
    scores = torch.empty(1, 4, 13, 13, device="meta")  # [b, heads, q, k], heads split
    layouts[id(scores)] = (-3, (4,))
    sinks = torch.empty(1, 4, 13, 1, device="meta")
    both = torch.cat([scores, sinks], dim=-1)
    propagate("cat", ([scores, sinks],), {"dim": -1}, both, layouts)
    assert layouts[id(both)] == (-3, (4,))
    lse = torch.logsumexp(scores, dim=-1)
    propagate("logsumexp", (scores,), {"dim": -1}, lse, layouts)
    assert layouts[id(lse)] == (-2, (4,))
    over_heads = scores.sum(1)
    propagate("sum", (scores, 1), {}, over_heads, layouts)
    assert id(over_heads) not in layouts  # summed over the split heads: ``check_reduction``'s
    empty = torch.empty(0, device="meta")
    cache = torch.cat([empty, scores], dim=-2)
    propagate("cat", ([empty, scores],), {"dim": -2}, cache, layouts)
    assert id(cache) not in layouts
