"""Tiny random configs of any causal-LM model type, from the model's own config defaults.

Only sizes are shrunk (widths, depths, head counts, vocabulary, experts); everything else a
model type's config says by default stays as published: token ids (brought inside the small
vocabulary), sliding windows, rope variants, per-layer attribute lists (cut to the layers
kept, one layer of every kind). Dropout is switched off, because parity needs it.
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
}
OTHER = {
    "vocab_size": VOCAB,
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
    "image_size": 32,
    "patch_size": 8,
}
SIZES = {**WIDTH, **FFN, **DEPTH, **HEADS, **HEAD_DIM, **OTHER}
# how many leading layers are dense in a mixture-of-experts model (DeepSeek-V3's 3 of 61): a layer
# index, scaled with the depth so that a model with both kinds keeps both (at least one MoE layer)
FIRST_DENSE = ("first_k_dense_replace", "num_dense_layers")
# 'max_position_embeddings' etc. must stay >= the sequences trained on; a sliding window above it is left alone


def _per_layer_keys(d: dict, layers: int) -> list[str]:
    return [k for k, v in d.items() if isinstance(v, list) and len(v) == layers and layers > 2]


def _small(k: str, v, ref=None):
    """The shrunk value of size ``k`` (``ref``: the global value it is a multiple of, per layer)."""
    if isinstance(ref, int) and ref > 0 and v % ref == 0 and v > ref:
        return min(SIZES[k] * (v // ref), 4 * SIZES[k])
    return SIZES[k] if v > SIZES[k] else v


def shrink(d: dict) -> dict:
    """A shrunk copy of a config dict (and of its sub-config dicts)."""
    d = dict(d)
    layers = next((d[k] for k in DEPTH if isinstance(d.get(k), int)), None)
    # per-layer lists and per_layer_config: keep one layer of each kind (first occurrences),
    # the same layers everywhere
    keys = _per_layer_keys(d, layers) if isinstance(layers, int) else []
    per_layer = d.get("per_layer_config") if isinstance(d.get("per_layer_config"), dict) else None
    keep = None
    if keys or per_layer:
        keep = {0, 1}
        for k in keys:
            seen = {}
            for i, v in enumerate(d[k]):
                seen.setdefault(repr(v), i)
            keep |= set(seen.values())
        if per_layer:
            seen = {}
            for i, v in sorted((int(i), v) for i, v in per_layer.items()):
                seen.setdefault(repr(v), i)
            keep |= set(seen.values())
        keep = sorted(keep)[:4]
        for k in keys:
            d[k] = [d[k][i] for i in keep]
        if per_layer:
            width = len(next(iter(per_layer)))
            d["per_layer_config"] = {
                str(new).zfill(width): {
                    kk: _small(kk, vv, d.get(kk)) if kk in SIZES and isinstance(vv, int) else vv
                    for kk, vv in per_layer[str(old).zfill(width)].items()
                }
                for new, old in enumerate(keep)
                if str(old).zfill(width) in per_layer
            }
    original = dict(d)
    for k, v in list(d.items()):
        if k == "per_layer_config":
            continue
        if isinstance(v, dict) and ("model_type" in v or k.endswith(("_config", "config"))):
            d[k] = shrink(v)
        elif k in SIZES and isinstance(v, int) and not isinstance(v, bool) and v > SIZES[k]:
            d[k] = SIZES[k]
        elif isinstance(v, float) and ("dropout" in k or k.endswith("pdrop")):
            d[k] = 0.0
        elif k in ("init_std", "initializer_range") and isinstance(v, float) and v >= 1.0:
            # CPM-Ant draws every weight from N(0, 1): the random model is chaotic (logits std 8,
            # loss 24; its fp32 one-process run is 3e-4 off the fp64 one at step 1, 1.5% at step 3),
            # so a 1e-4 parity check could not be decided on it. 0.02, as most types default to.
            d[k] = 0.02
    # head sizes equal in the published config stay equal (DeepSeek's head_dim is its rope dim)
    dims = [k for k in HEAD_DIM if isinstance(original.get(k), int)]
    for k in dims:
        same = [j for j in dims if original[j] == original[k]]
        d[k] = min(d[j] for j in same)
    if all(isinstance(d.get(k), int) for k in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")):
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    if keep is not None:
        for k in DEPTH:
            if isinstance(d.get(k), int):
                d[k] = len(keep)
    depth = next((d[k] for k in DEPTH if isinstance(d.get(k), int)), None)
    for k in FIRST_DENSE:
        first, layers = original.get(k), next((original[j] for j in DEPTH if isinstance(original.get(j), int)), None)
        if isinstance(first, int) and isinstance(layers, int) and 0 < first < layers and first >= depth:
            d[k] = max(1, depth - 1)
    heads = next((d[k] for k in HEADS if isinstance(d.get(k), int)), None)
    for k in KV_HEADS:
        if isinstance(d.get(k), int) and heads:
            d[k] = heads if d[k] >= heads else min(2, heads)
    # SSMs (Mamba-2 style): heads * head_dim must equal expand * hidden
    hidden, expand = d.get("hidden_size"), d.get("expand") or d.get("mamba_expand")
    for hk, dk in (("num_heads", "head_dim"), ("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim")):
        if isinstance(expand, int) and isinstance(hidden, int) and isinstance(d.get(hk), int) and d.get(dk):
            d[hk] = expand * hidden // d[dk]
    if "is_decoder" in d and not d.get("is_encoder_decoder"):
        d["is_decoder"] = True  # encoders used as causal LMs (BERT-likes, Reformer) need it
    # token ids outside the small vocabulary: moved to its top, one slot each
    vocab = d.get("vocab_size")
    if isinstance(vocab, int):
        top = vocab - 1
        for k, v in d.items():
            if k.endswith(("_token_id", "_token_index", "_token_ids")):
                if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
                    d[k], top = top, top - 1
                elif isinstance(v, list):
                    fixed = []
                    for x in v:
                        if isinstance(x, int) and x >= vocab:
                            x, top = top, top - 1
                        fixed.append(x)
                    d[k] = fixed
    return d


def tiny_config(model_type: str):
    """The config of ``model_type`` from its own defaults, sizes shrunk (see the module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    d = shrink(cls().to_dict())
    d.pop("transformers_version", None)
    config = cls.from_dict(d)
    config.use_cache = False
    return config
