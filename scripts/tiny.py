"""Tiny random configs of any causal-LM model type, from the model's own config defaults.

Only sizes are shrunk (widths, depths, head counts, vocabulary, experts); everything else a
model type's config says by default stays as published: token ids (brought inside the small
vocabulary), sliding windows, rope variants, per-layer attribute lists (cut to the layers
kept, one layer of every kind); a list of feed-forward widths (Gemma 3n's per-layer ``intermediate_size``)
is shrunk item by item, a width that is a multiple of the smallest staying that multiple (up to 4x).
Dropout is switched off, because parity needs it.

Sizes a config validates against each other stay consistent, one rule per constraint (each
named after the type that showed it): the config's own ``attribute_map`` names its routing sizes
(``_aliases``); top-k within the experts, expert groups dividing them (``_routing``); widths that are
a multiple of the hidden size stay so (``_widths``); head sizes that are width / heads, or the sum
of MLA's nope and rope dims, stay so (``_head_dims``); layer counts that sum to the depth still do
(``_depth``); a partial rotary factor leaves an even number of rotary dims (``_rotary``); lists of
layer indices follow the layers kept, and the cache-sharing layers keep a producer of each kind
(``_cut_layers``); head counts stay apart from a hyper-connection stream count (``_streams``); widths one
sub-config reads off another stay equal (``_cross_widths``).
What no rule can mend (a default that misses a value its own model reads) is in ``OVERRIDES`` /
``AFTER``, each with why; types that cannot run on text rows at all are in ``NOT_BUILDABLE``
with the transformers-side or package reason (``tiny_config`` raises ``NotBuildable``).
"""

from __future__ import annotations

VOCAB = 256
WIDTH = {  # hidden widths
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "word_embed_proj_dim": 64,
    "embedding_size": 64,
    "attention_hidden_size": 64,
    "backbone_hidden_size": 64,
    "embed_dim": 64,
    "emb_dim": 64,  # XLM
    "embedding_dim": 64,  # xLSTM
}
FFN = {
    "intermediate_size": 128,
    "ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "n_inner": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "ffn_hidden_size": 128,
    "dim_ff": 128,
    "dff": 128,
    "dense_intermediate_size": 128,
    "intermediate_size_mlp": 128,
    "expert_ffn_hidden_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "shared_intermediate_size": 64,
    "shared_experts_intermediate_size": 64,
    "mamba_d_ssm": 128,
}
DEPTH = {
    "num_hidden_layers": 2,
    "n_layer": 2,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "num_layers": 2,
    "n_layers": 2,
    "num_encoder_layers": 2,
}
HEADS = {
    "num_attention_heads": 4,
    "n_head": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "n_heads": 4,
    "num_heads": 4,
    "swa_num_attention_heads": 4,
    "index_n_heads": 4,
    "linear_num_value_heads": 4,
    "linear_num_heads": 4,
    "mamba_n_heads": 4,
    "num_encoder_attention_heads": 4,
    "mamba_num_heads": 4,
}
KV_HEADS = ("num_key_value_heads", "swa_num_key_value_heads", "linear_num_key_heads", "num_kv_heads")
HEAD_DIM = {
    "head_dim": 16,
    "swa_head_dim": 16,
    "kv_channels": 16,
    "attention_head_dim": 16,
    "dim_head": 16,
    "linear_head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "index_head_dim": 16,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "qk_head_dim": 24,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "rotary_dim": 8,
    "d_head": 16,  # XLNet
    "mamba_headdim": 16,  # Zamba2
    "indexer_head_dim": 16,
}
OTHER = {
    "vocab_size": VOCAB,
    # Inkling 2's LM head: the published vocabulary less its padded rows (200058 of 201024), restored as zeros
    # on save; left at 200058 it made a head of 200058 rows and save_pretrained pad by 256 - 200058 rows
    "unpadded_vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "n_ctx": 128,
    "max_seq_len": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "n_group": 1,
    "topk_group": 1,
    "mamba_d_state": 8,
    "state_size": 8,
    "ssm_state_size": 8,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "decoder_vocab_size": VOCAB,  # Marian
    "encoder_hash_byte_group_vocab": VOCAB,  # BLT's hashed byte n-grams
    "image_size": 32,
    "patch_size": 8,
    # Gemma 3n's and Gemma 4's per-layer input embeddings (256 per layer beside a hidden size of 1536 or
    # 2048): unshrunk, 4x the tiny hidden size, Gemma 4's fp32 one-process run was 9e-4 off its fp64
    # one in grad_norm at step 4, too far for a 1e-4 parity check to be decided
    "hidden_size_per_layer_input": 16,
}
SIZES = {**WIDTH, **FFN, **DEPTH, **HEADS, **HEAD_DIM, **OTHER}
# kv heads where the published config has fewer than its heads (``always``: also where it has as many)
KV = {"heads": 2, "always": False}
# The matrix's second size set (issue 27): the widths the first one makes equal or even made unequal,
# to find what those sizes hide: 8 heads and 4 kv heads (neither 2), a hidden size (96) that is not
# heads x head_dim (16) and that the intermediate size (160) is no multiple of, an odd vocabulary (253:
# split unevenly over TP), 6 experts of 48
SIZE_SETS = {
    "equal": ({}, {"heads": 2, "always": False}),
    "unequal": (
        {
            **{k: 96 for k in WIDTH},
            **{k: 160 if v == 128 else 48 for k, v in FFN.items()},
            **{k: 8 for k in HEADS},
            **{k: 253 for k, v in OTHER.items() if v == VOCAB},
            **{k: 6 for k, v in OTHER.items() if v == 4 and "expert" in k},
        },
        {"heads": 4, "always": True},
    ),
}
# the same with an even vocabulary (254): the second set while shardlm refused a vocabulary tp does not divide
# (now split in torch's chunks, issue 27); kept for the matrix rows measured with it
SIZE_SETS["unequal_even"] = (
    {**SIZE_SETS["unequal"][0], **{k: 254 for k, v in OTHER.items() if v == VOCAB}},
    SIZE_SETS["unequal"][1],
)
# how many leading layers are dense in a mixture-of-experts model (DeepSeek-V3's 3 of 61): a layer
# index, scaled with the depth so that a model with both kinds keeps both (at least one MoE layer)
FIRST_DENSE = ("first_k_dense_replace", "num_dense_layers")
# 'max_position_embeddings' etc. must stay >= the sequences trained on; a sliding window above it is left alone
# routing sizes a default config may leave None although the model reads them (DeepSeek-V2's top-k,
# dots1's expert counts): the published checkpoints set them, so the tiny model does too
ROUTING_IF_NONE = {"num_experts_per_tok": 2, "n_routed_experts": 4, "n_shared_experts": 1}
ROUTING = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group")
# head sizes a model derives from a width when they equal width / heads (XLNet validates it)
DERIVED_HEAD_DIMS = ("head_dim", "d_head", "attention_head_dim", "kv_channels")
WIDTHS_OF_HEADS = ("attention_hidden_size", "hidden_size", "d_model")

# Defaults that no size rule can mend: the config class's default misses a value its own model
# reads (each published checkpoint's config.json carries it). Applied to the default dict before
# shrinking.
OVERRIDES = {
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no longer declares
    # (transformers moved it to the top-level rope_parameters); DBRX's config.json has it there
    # (and clamps q/k/v with clip_qkv, None by default: DBRX's config.json has 8)
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # the rotary embedding looks up rope_parameters[layer_type]; the default dict is empty
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # every layer reads layer_types[i] ("conv" or attention); the default is None. LFM2-8B-A1B's:
    # attention at layers 2, 6, 10, 14, 18, 21 of 24, short convolutions elsewhere
    "lfm2_moe": {
        "num_hidden_layers": 24,
        "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
    },
    # every indexed_attention layer builds the QSA indexer from these, all None by default
    # (validate_architecture: one key head, budget a multiple of the compression ratio)
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # the X-MOD adapters are chosen per language; without a default one the forward raises
    "xmod": {"default_language": "en_XX"},
}
OVERRIDES["qwen4_exp"] = {"text_config": OVERRIDES["qwen4_exp_text"]}
# Sizes the rules above get wrong for one type, set after shrinking.
AFTER = {
    # MiMo-V2-Flash's sliding-window layers have twice the kv heads: the rule's 4 (all the query heads,
    # as the published 4 kv heads are not fewer than 4) would be 8 kv heads for 4 query heads; the
    # published 64 query / 4 kv heads are grouped, so 2
    "mimo_v2_flash": {"num_key_value_heads": 2},
    # Dory's dict counts blocks (an attention block then an mlp block per layer: every count doubled,
    # validate_architecture checks the halves): three layers, one each of input, recurrent, output
    "dory": {
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention", "mlp", "sliding_attention", "mlp", "full_attention", "mlp"],
        "n_input_layers": 2,
        "n_recurrent_layers": 2,
        "n_output_layers": 2,
    },
    # Dots 3's sliding layers override qk_nope_head_dim per layer (192 + rope 64 = the global head_dim
    # 256, which validate_architecture checks); shrunk, nope 16 + rope 8
    "dots3_note_text": {"head_dim": 24},
    # head_dim None by default, and the attention reads config.head_dim (getattr's fallback to
    # hidden / heads never applies: the attribute exists); published checkpoints set it
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    "ministral": {"head_dim": 16},
    # the per-layer input embeddings (262144 x 256 per layer: 400M parameters at 6 layers) on the
    # small vocabulary
    "gemma3n_text": {"vocab_size_per_layer_input": VOCAB},
    # DBRX's attention reads its kv heads from attn_config.kv_n_heads (1 by default: multi-query); the
    # top-level num_key_value_heads its config derives from it must not be shrunk to another count
    "dbrx": {"num_key_value_heads": 1},
    # Laguna's per-layer head counts default to None (num_attention_heads for every layer, filled in by its
    # __post_init__): left to it, so they follow the shrunk head count rather than keep the published 48
    "laguna": {"num_attention_heads_per_layer": None},
}
AFTER["dots3_note"] = {"text_config": AFTER["dots3_note_text"]}
# Gemma 4's per-layer input embeddings (262144 x 256 per layer), as Gemma 3n's
AFTER["gemma4_text"] = {"vocab_size_per_layer_input": VOCAB}
AFTER["gemma4"] = {"text_config": AFTER["gemma4_text"]}
# Sub-configs every published checkpoint has that the config class leaves None by default: built from
# their own defaults, then shrunk with the rest (Gemma 4 is published with a vision tower)
SUB_DEFAULTS = {"gemma4": {"vision_config": "gemma4_vision"}}
# Kinds of layer kept twice: Zamba and Zamba2 tie one shared transformer block across their hybrid layers (a
# tie needs two of them; Zamba2's block holds one adapter per hybrid layer, each run under its own layer only)
KEEP_TWICE = {"zamba": "hybrid", "zamba2": "hybrid"}

# Types no tiny config can make trainable on text rows in one process, and the transformers-side
# or package reason (the matrix records it as the row's build result).
NOT_BUILDABLE = {
    "gemma3n": "Gemma3nForConditionalGeneration's vision tower is a TimmWrapperModel: it needs the timm package, "
    "which imports torchvision, whose PyPI wheels do not load beside the CPU build of torch make setup installs "
    "(each wants its own CUDA torch, several GB), so neither is a dependency; its text model is gemma3n_text",
    "gemma4_assistant": "a speculative-decoding drafter: its forward takes the target model's inputs_embeds and "
    "shared_kv_states (every layer reuses the target's KV cache), so it cannot run on token ids alone",
    "gemma4_unified_assistant": "a speculative-decoding drafter: its forward takes the target model's inputs_embeds "
    "and shared_kv_states (every layer reuses the target's KV cache), so it cannot run on token ids alone",
    "git": "GitForCausalLM's loss drops the first (image_size/patch_size)^2+1 logits for the image tokens whether or "
    "not pixel_values are given (modeling_git.py), so a text row has no loss",
    "musicgen": "an audio-codebook decoder: input_ids are (batch x num_codebooks, seq) and labels (batch, seq, "
    "num_codebooks), one head per codebook; not a text causal LM",
    "musicgen_melody": "an audio-codebook decoder: input_ids are (batch x num_codebooks, seq) and labels (batch, "
    "seq, num_codebooks), one head per codebook; not a text causal LM",
}


class NotBuildable(Exception):
    """A type that cannot be trained on text rows, for the reason in ``NOT_BUILDABLE``."""


def _per_layer_keys(d: dict, layers: int) -> list[str]:
    return [k for k, v in d.items() if isinstance(v, list) and len(v) == layers and layers > 2]


def _small(k: str, v, ref=None):
    """The shrunk value of size ``k`` (``ref``: the global value it is a multiple of, per layer)."""
    if isinstance(ref, int) and ref > 0 and v % ref == 0 and v > ref:
        return min(SIZES[k] * (v // ref), 4 * SIZES[k])
    return SIZES[k] if v > SIZES[k] else v


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kept_layers(d: dict, layers: int, keys: list[str], per_layer: dict | None) -> list[int]:
    """One layer of each kind (first occurrences) of every per-layer list, at most 4; a model whose
    last ``num_kv_shared_layers`` reuse earlier layers' caches (Gemma 3n) keeps one of each kind
    on both sides of that line, so that every kind reusing a cache still has one producing it."""
    shared = d.get("num_kv_shared_layers")
    first_shared = layers - shared if _int(shared) and 0 < shared < layers else layers
    keep = {0, 1}
    twice = KEEP_TWICE.get(d.get("model_type"))
    for k in keys:
        seen, count = {}, {}
        for i, v in enumerate(d[k]):
            count[repr(v)] = count.get(repr(v), 0) + 1
            seen.setdefault((repr(v), i >= first_shared, v == twice and count[repr(v)] > 1), i)
        keep |= set(seen.values())
    if per_layer:
        seen = {}
        for i, v in sorted((int(i), v) for i, v in per_layer.items()):
            seen.setdefault(repr(v), i)
        keep |= set(seen.values())
    return sorted(keep)[: 4 if first_shared == layers else 6]


def _cut_layers(d: dict) -> list[int] | None:
    """Per-layer lists and per_layer_config cut to the layers kept (the same layers everywhere)."""
    layers = next((d[k] for k in DEPTH if _int(d.get(k))), None)
    keys = _per_layer_keys(d, layers) if _int(layers) else []
    per_layer = d.get("per_layer_config") if isinstance(d.get("per_layer_config"), dict) else None
    if not (keys or per_layer):
        return None
    keep = _kept_layers(d, layers, keys, per_layer)
    for k in keys:
        d[k] = [d[k][i] for i in keep]
    for k, v in list(d.items()):  # lists of layer indices (Zamba2's hybrid_layer_ids): renumbered
        if k.endswith(("_layer_ids", "_layer_idxs")) and isinstance(v, list) and all(_int(i) for i in v):
            d[k] = [keep.index(i) for i in v if i in keep]
    if _int(d.get("num_kv_shared_layers")) and 0 < d["num_kv_shared_layers"] < layers:
        d["num_kv_shared_layers"] = sum(i >= layers - d["num_kv_shared_layers"] for i in keep)
    if per_layer:
        width = len(next(iter(per_layer)))
        d["per_layer_config"] = {
            str(new).zfill(width): _shrink_layer_entry(per_layer[str(old).zfill(width)], d)
            for new, old in enumerate(keep)
            if str(old).zfill(width) in per_layer
        }
    return keep


def _shrink_layer_entry(entry: dict, d: dict) -> dict:
    """One per_layer_config entry: sizes shrunk as the global ones, kv heads as in ``_kv_heads`` (an MLA
    entry's, Dots 3's sliding layers, stay its heads). A latent's rank narrower than the published width
    stays narrower than the tiny one: the global rank, not its multiple (Dots 3's sliding layers'
    ``kv_lora_rank`` 1024 of 5120 would be 64 of 64, a latent no narrower than what it reads)."""
    out = {k: _small(k, v, d.get(k)) if k in SIZES and _int(v) else v for k, v in entry.items()}
    width = next((d[k] for k in WIDTH if _int(d.get(k))), None)
    for k, v in entry.items():
        if k.endswith("lora_rank") and _int(v) and width and v < width and out[k] >= SIZES["hidden_size"]:
            out[k] = SIZES[k]
    heads = next((out[k] for k in HEADS if _int(out.get(k))), None)
    mla = _int(out.get("kv_lora_rank", d.get("kv_lora_rank")))
    for k in KV_HEADS:
        if _int(entry.get(k)) and heads:
            orig_heads = next(entry[j] for j in HEADS if _int(entry.get(j)))
            same = entry[k] >= orig_heads and (not KV["always"] or mla and k == "num_key_value_heads")
            out[k] = heads if same else _kv_divisor(heads)
    return out


def _aliases(model_type: str | None) -> dict[str, str]:
    """``{key as stored: standard name}`` from the config class's own ``attribute_map`` (Ernie-4.5-MoE
    stores top-k as ``moe_k``, Bailing the expert groups as ``num_expert_group``): routing sizes only,
    which must agree with each other."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type] if model_type and model_type in CONFIG_MAPPING else None
    amap = getattr(cls, "attribute_map", None) or {}
    return {real: std for std, real in amap.items() if std in ROUTING and real not in SIZES}


def shrink(d: dict) -> dict:
    """A shrunk copy of a config dict (and of its sub-config dicts)."""
    d = dict(d)
    keep = _cut_layers(d)
    aliases = _aliases(d.get("model_type"))
    original = dict(d)
    for k, v in list(d.items()):
        size = SIZES.get(aliases.get(k, k))
        if k == "per_layer_config":
            continue
        if isinstance(v, dict) and ("model_type" in v or k.endswith(("_config", "config"))):
            d[k] = shrink(v)
        elif size is not None and _int(v) and v > size:
            d[k] = size
        elif k in FFN and isinstance(v, list) and v and all(_int(x) and x > 0 for x in v):
            d[k] = [_small(k, x, min(v)) for x in v]  # per-layer widths (Gemma 3n's intermediate_size)
        elif isinstance(v, float) and ("dropout" in k or k.endswith("pdrop")):
            d[k] = 0.0
        elif k in ("init_std", "initializer_range") and isinstance(v, float) and v >= 1.0:
            # CPM-Ant draws every weight from N(0, 1): the random model is chaotic (logits std 8,
            # loss 24; its fp32 one-process run is 3e-4 off the fp64 one at step 1, 1.5% at step 3),
            # so a 1e-4 parity check could not be decided on it. 0.02, as most types default to.
            d[k] = 0.02
    _streams(d, original)
    _widths(d, original)
    _head_dims(d, original)
    _depth(d, original, keep)
    _routing(d, original)
    _kv_heads(d, original)
    _rotary(d, original)
    _ssm_heads(d)
    if "is_decoder" in d and not d.get("is_encoder_decoder"):
        d["is_decoder"] = True  # encoders used as causal LMs (BERT-likes, Reformer) need it
    _reformer_axial(d, original)
    _token_ids(d)
    return d


def _streams(d: dict, original: dict) -> None:
    """Head counts the published config keeps different from its hyper-connection stream count stay different
    (DeepSeek-V4's and HY-v4's 64 heads, ``hc_mult`` 4 streams): shrunk to 4, the streams [B, S, hc_mult, hidden]
    would share the head count, and plan inference would take them for per-head tensors. Doubled instead."""
    streams = d.get("hc_mult")
    if not _int(streams):
        return
    for k in HEADS:
        if _int(d.get(k)) and d[k] == streams and original.get(k) != streams:
            d[k] *= 2


def _widths(d: dict, original: dict) -> None:
    """Widths that are a multiple of the hidden size in the published config stay that multiple
    (Zamba's attention runs on [hidden, embeddings] concatenated: twice the hidden size)."""
    hidden, was = d.get("hidden_size"), original.get("hidden_size")
    if not (_int(hidden) and _int(was) and was > 0):
        return
    for k in WIDTH:
        v = original.get(k)
        if k != "hidden_size" and _int(v) and v != was and v % was == 0 and 2 <= v // was <= 4:
            d[k] = hidden * (v // was)


def _head_dims(d: dict, original: dict) -> None:
    """Head sizes equal in the published config stay equal (DeepSeek's head_dim is its rope dim);
    a head size that is width / heads there stays so (XLNet validates ``d_head == d_model // n_head``)."""
    dims = [k for k in HEAD_DIM if _int(original.get(k))]
    for k in dims:
        same = [j for j in dims if original[j] == original[k]]
        d[k] = min(d[j] for j in same)
    heads_key = next((k for k in HEADS if _int(original.get(k))), None)
    if heads_key:
        for k in DERIVED_HEAD_DIMS:
            for w in WIDTHS_OF_HEADS:
                v, width = original.get(k), original.get(w)
                if _int(v) and _int(width) and v * original[heads_key] == width and v > SIZES[k]:
                    d[k] = d[w] // d[heads_key]
                    break
    if all(_int(d.get(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim")):
        qk = original["qk_nope_head_dim"] + original["qk_rope_head_dim"]
        for k in ("qk_head_dim", "swa_head_dim"):  # MLA's query/key head, Dots 3's SWA heads of that size
            if k == "qk_head_dim" and _int(d.get(k)) or original.get(k) == qk:
                d[k] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]


def _depth(d: dict, original: dict, keep: list[int] | None) -> None:
    """The depth is the number of layers kept (under every name it has); the leading dense layers of a
    MoE stay fewer than it;
    layer counts that sum to the depth (Dory's input + recurrent + output layers) still do."""
    if keep is not None:
        for k in DEPTH:
            if _int(d.get(k)):
                d[k] = len(keep)
    depth = next((d[k] for k in DEPTH if _int(d.get(k))), None)
    layers = next((original[j] for j in DEPTH if _int(original.get(j))), None)
    if _int(original.get("num_blocks")) and original["num_blocks"] == layers:
        d["num_blocks"] = depth  # xLSTM's second name for its depth
    for k in FIRST_DENSE:
        first = original.get(k)
        if _int(first) and _int(layers) and 0 < first < layers and first >= depth:
            d[k] = max(1, depth - 1)
    parts = [k for k, v in original.items() if _int(v) and k.startswith("n_") and k.endswith("_layers") and v > 0]
    if _int(layers) and len(parts) > 1 and sum(original[k] for k in parts) == layers and len(parts) <= depth:
        for i, k in enumerate(parts):
            d[k] = 1 + (depth - len(parts) if i == 0 else 0)


def _stored(d: dict, std: str) -> str | None:
    """The key ``d`` stores the standard size ``std`` under (itself or its attribute_map alias)."""
    if std in d:
        return std
    return next((k for k, v in _aliases(d.get("model_type")).items() if v == std and k in d), None)


def _routing(d: dict, original: dict) -> None:
    """Routing sizes the default leaves None get the tiny ones when the model has experts; top-k
    stays within the experts, the expert groups divide them (two experts a group at least) and
    the groups picked stay within the groups."""
    counts = [_stored(d, k) for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")]
    counts = [k for k in counts if k]
    if not counts:
        return
    none = all(d[k] is None for k in counts)
    if none or any(_int(d[k]) and d[k] > 0 for k in counts):
        for std, v in ROUTING_IF_NONE.items():
            k = _stored(d, std)
            if k and d[k] is None and (std != "n_shared_experts" or none):
                d[k] = v
    experts = next((d[k] for k in counts if _int(d[k]) and d[k] > 0), None)
    topk, groups, picked = (_stored(d, k) for k in ("num_experts_per_tok", "n_group", "topk_group"))
    if experts is None:
        return
    if topk and _int(d[topk]) and d[topk] > experts:
        d[topk] = min(2, experts)
    if groups and _int(d[groups]) and d[groups] > 1 and (experts % d[groups] or experts // d[groups] < 2):
        d[groups] = 1
    if picked and groups and _int(d[picked]) and _int(d[groups]) and d[picked] > d[groups]:
        d[picked] = d[groups]


def _kv_heads(d: dict, original: dict) -> None:
    """As many kv heads as heads if there were (a None default means that too: Nemotron), else 2 (the
    second size set: 4 kv heads in every case, ``SIZE_SETS``), a divisor of the heads (nanochat keeps
    its 6 heads: 2 kv heads, even ones first so that tp=2 divides them). MLA (DeepSeek-V3: a
    ``kv_lora_rank``) has one key and value per query head, up-projected from the latent, so its kv
    heads stay the heads in every size set (Dots 3 validates it; the others repeat the keys by
    heads / kv heads and fail in the attention)."""
    heads = next((d[k] for k in HEADS if _int(d.get(k))), None)
    mla = _int(d.get("kv_lora_rank"))
    for k in KV_HEADS:
        if heads and _int(d.get(k)):
            same = d[k] >= heads and (not KV["always"] or mla and k == "num_key_value_heads")
            d[k] = heads if same else _kv_divisor(heads)
        elif heads and k == "num_key_value_heads" and k in d and d[k] is None:
            d[k] = _kv_divisor(heads) if KV["always"] and not mla else heads


def _kv_divisor(heads: int) -> int:
    """The kv heads of the size set (``KV["heads"]``) for ``heads`` query heads: the largest divisor of
    them not above it, an even one if there is."""
    fits = [n for n in range(1, min(KV["heads"], heads) + 1) if heads % n == 0]
    return max([n for n in fits if n % 2 == 0] or fits)


def _rotary_factor(d: dict) -> float | None:
    rope = d.get("rope_parameters")
    found = [d.get("partial_rotary_factor")]
    if isinstance(rope, dict):
        found.append(rope.get("partial_rotary_factor"))
        found += [r.get("partial_rotary_factor") for r in rope.values() if isinstance(r, dict)]
    found = [f for f in found if isinstance(f, float) and 0 < f < 1]
    return min(found) if found else None


def _rotary(d: dict, original: dict) -> None:
    """A partial rotary factor leaves an even number of rotary dims, as the published head size does
    (MiMo-V2-Flash: 0.334 of 192 is 64; of 16 it would be 5): the head grows to the next size that does,
    by 8 (by 4 where 8 never does: Qwen3.5's 0.25 of 12, 20, 28, ...). A head size the model derives as
    hidden / heads (StableLM: no ``head_dim``; 96 / 8 = 12, 0.25 of it 3) grows with the hidden size."""
    factor, head = _rotary_factor(d), d.get("head_dim")
    heads = next((d[k] for k in HEADS if _int(d.get(k))), None)
    derived = head is None and _int(d.get("hidden_size")) and _int(heads) and d["hidden_size"] % heads == 0
    if derived:
        head = d["hidden_size"] // heads
    if factor is None or not _int(head) or (int(head * factor) % 2 == 0 and int(head * factor) > 0):
        return
    sizes = [*range(head + 8, 8 * head, 8), *range(head + 4, 8 * head, 4)]
    new = next(h for h in sizes if int(h * factor) % 2 == 0 and int(h * factor) > 0)
    if derived:
        d["hidden_size"] = new * heads
        return
    for k in HEAD_DIM:
        if d.get(k) == head and original.get(k) == original.get("head_dim"):
            d[k] = new


def _ssm_heads(d: dict) -> None:
    """SSMs (Mamba-2 style): heads * head_dim must equal the mixer's width: ``mamba_d_ssm`` where the
    config sets it (Falcon-H1: 1024 beside expand x hidden 8192; shrunk, 160 at the second size set),
    else expand * hidden."""
    hidden, expand = d.get("hidden_size"), d.get("expand") or d.get("mamba_expand")
    if _int(d.get("mamba_d_ssm")) and _int(expand):
        hidden, expand = d["mamba_d_ssm"], 1
    pairs = (
        ("num_heads", "head_dim"),
        ("mamba_n_heads", "mamba_d_head"),
        ("mamba_num_heads", "mamba_head_dim"),
        ("n_mamba_heads", "mamba_headdim"),
    )
    for hk, dk in pairs:
        if _int(expand) and _int(hidden) and _int(d.get(hk)) and d.get(dk):
            d[hk] = expand * hidden // d[dk]


def _reformer_axial(d: dict, original: dict) -> None:
    """Axial position embeddings: their widths sum to the hidden size and, in training, their shape
    multiplies to the sequence length (16 here), which the attention chunks divide."""
    dims, shape = original.get("axial_pos_embds_dim"), d.get("axial_pos_shape")
    if not (isinstance(dims, list) and isinstance(shape, list) and _int(d.get("hidden_size"))):
        return
    scale = d["hidden_size"] / sum(dims)
    d["axial_pos_embds_dim"] = [int(v * scale) for v in dims[:-1]]
    d["axial_pos_embds_dim"].append(d["hidden_size"] - sum(d["axial_pos_embds_dim"]))
    d["axial_pos_shape"] = [4, 4]
    for k in ("local_attn_chunk_length", "lsh_attn_chunk_length"):
        if _int(d.get(k)):
            d[k] = 8


def _token_ids(d: dict) -> None:
    """Token ids outside the small vocabulary: moved to its top, one slot each."""
    vocab = d.get("vocab_size")
    if not _int(vocab):
        return
    top = vocab - 1
    for k, v in d.items():
        if k.endswith(("_token_id", "_token_index", "_token_ids")):
            if _int(v) and v >= vocab:
                d[k], top = top, top - 1
            elif isinstance(v, list):
                fixed = []
                for x in v:
                    if _int(x) and x >= vocab:
                        x, top = top, top - 1
                    fixed.append(x)
                d[k] = fixed


def _cross_widths(original: dict, d: dict) -> None:
    """Widths one sub-config reads off another stay equal to it: a sub-config's ``hidden_size_<name>``
    is the width of the ``<name>_config`` next to it (BLT's local encoder and decoder read the global
    transformer's), and an adapter's in/out width that was its own tower's or the text model's
    hidden size still is (Dots 3's vision and audio adapters)."""
    text, text_was = d.get("text_config") or {}, original.get("text_config") or {}
    for name, sub in d.items():
        if not (isinstance(sub, dict) and name.endswith("config")):
            continue
        was = original.get(name) or {}
        for k in [k for k in sub if isinstance(k, str) and _int(sub[k])]:
            other = d.get(k.removeprefix("hidden_size_") + "_config") if k.startswith("hidden_size_") else None
            if isinstance(other, dict) and _int(other.get("hidden_size")):
                sub[k] = other["hidden_size"]
            elif "adapter" in k and was.get(k) == was.get("hidden_size"):
                sub[k] = sub["hidden_size"]
            elif "adapter" in k and was.get(k) == text_was.get("hidden_size") and _int(text.get("hidden_size")):
                sub[k] = text["hidden_size"]


def _merge(d: dict, over: dict) -> dict:
    out = dict(d)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_config(model_type: str, sizes: str = "equal"):
    """The config of ``model_type`` from its own defaults, sizes shrunk (see the module docstring) to the
    size set ``sizes`` (``SIZE_SETS``)."""
    if model_type in NOT_BUILDABLE:
        raise NotBuildable(NOT_BUILDABLE[model_type])
    saved, kv = dict(SIZES), dict(KV)
    SIZES.update(SIZE_SETS[sizes][0])
    KV.update(SIZE_SETS[sizes][1])
    try:
        return _tiny_config(model_type)
    finally:
        SIZES.clear()
        SIZES.update(saved)
        KV.update(kv)


def _tiny_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    original = _merge(cls().to_dict(), OVERRIDES.get(model_type, {}))
    for key, sub_type in SUB_DEFAULTS.get(model_type, {}).items():
        original[key] = CONFIG_MAPPING[sub_type]().to_dict()
    d = _merge(shrink(original), AFTER.get(model_type, {}))
    _cross_widths(original, d)
    d.pop("transformers_version", None)
    config = cls.from_dict(d)
    config.use_cache = False
    return config
