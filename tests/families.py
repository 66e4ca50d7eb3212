"""Tiny random configs of every model family shardlm's AutoTP is tested on (dropout off: the plain
reference uses torch's own dropout; ``test_dropout.py`` turns it on against shardlm's masks)."""

from __future__ import annotations

import os

VOCAB = 64


def family_config(family: str, **overrides):
    import transformers as tf

    base = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, hidden_size=32)
    specs = {
        "llama": (tf.LlamaConfig, dict(intermediate_size=64, num_key_value_heads=2)),
        "mistral": (tf.MistralConfig, dict(hidden_size=48, intermediate_size=64, num_key_value_heads=2)),
        "qwen2": (tf.Qwen2Config, dict(intermediate_size=64, num_key_value_heads=2)),
        "qwen3": (tf.Qwen3Config, dict(intermediate_size=64, num_key_value_heads=2, head_dim=8)),
        "gemma": (tf.GemmaConfig, dict(intermediate_size=64, num_key_value_heads=2, head_dim=8)),
        "granite": (
            tf.GraniteConfig,
            dict(
                intermediate_size=64,
                num_key_value_heads=2,
                embedding_multiplier=2.0,
                residual_multiplier=0.5,
                logits_scaling=2.0,
            ),
        ),
        "phi3": (tf.Phi3Config, dict(intermediate_size=64, num_key_value_heads=4, pad_token_id=0)),
        # GQA: packed qkv_proj of unequal parts [q 32, k 16, v 16]
        "phi3_gqa": (tf.Phi3Config, dict(intermediate_size=64, num_key_value_heads=2, pad_token_id=0)),
        "gpt2": (
            tf.GPT2Config,
            dict(
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        "gpt_neox": (tf.GPTNeoXConfig, dict(intermediate_size=64, rotary_pct=0.5, bos_token_id=0, eos_token_id=0)),
        "opt": (
            tf.OPTConfig,
            dict(
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                ffn_dim=64,
                word_embed_proj_dim=32,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=1,
            ),
        ),
        "falcon": (
            tf.FalconConfig,
            dict(new_decoder_architecture=True, num_kv_heads=2, bos_token_id=0, eos_token_id=0),
        ),
        "stablelm": (
            tf.StableLmConfig,
            dict(intermediate_size=64, num_key_value_heads=2, bos_token_id=0, eos_token_id=0),
        ),
        "phi": (
            tf.PhiConfig,
            dict(
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attention_dropout=0.0,
                intermediate_size=64,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        "olmo": (
            tf.OlmoConfig,
            dict(intermediate_size=64, num_key_value_heads=2, pad_token_id=1, bos_token_id=0, eos_token_id=0),
        ),
        "olmo2": (
            tf.Olmo2Config,
            dict(intermediate_size=64, num_key_value_heads=2, pad_token_id=1, bos_token_id=0, eos_token_id=0),
        ),
    }
    cls, extra = specs[family]
    kwargs = {**base, **extra, **overrides}
    if family == "gpt2":
        for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
            kwargs.pop(k)
    return cls(**kwargs)


# models from their own type's config defaults, sizes shrunk (``scripts/tiny.py``), with overrides
# that keep a ratio of the published config the shrinking loses: Qwen3.5's Gated DeltaNet has
# twice as many value heads as key heads (16 / 32), each key head serving two consecutive ones; so
# have Qwen3-Next's (its q/k/v/z fused per key head) and OLMo-hybrid's (q, k, v projections apart).
# LFM3: a short convolution over one third of a fused in_proj. Kimi-Linear: delta attention (its
# forget and output gates low-rank pairs, ``latent.py``) and MLA, MoE. Mamba2 and Nemotron-H (a Mamba-2
# mixer, MoE, attention, MLP): n_groups=2 where their published configs have 8 (``tiny.py`` shrinks it to
# 1), so that tp=2 divides the groups of B and C. Bamba and Falcon-H1 (a Mamba-2 mixer beside attention)
# as published, n_groups=1: B and C held whole on every rank; Falcon-H1's mup_vector follows in_proj.
# Jamba, Mamba, Falcon-Mamba: Mamba-1 mixers, as published. Qwen3.5-MoE text: Qwen3.5's mixers with
# MoE (a shared expert and its gate) in every block; one block of each kind (its tiny config keeps
# two Gated DeltaNet blocks, which Qwen3.5 text covers: 5 s less on the spawns).
TINY = {
    "qwen3_5_text": ("qwen3_5_text", {"linear_num_key_heads": 2}),
    "qwen3_5_moe_text": (
        "qwen3_5_moe_text",
        {"linear_num_key_heads": 2, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
    ),
    "qwen3_next": ("qwen3_next", {"linear_num_key_heads": 2}),
    "olmo_hybrid": ("olmo_hybrid", {"linear_num_key_heads": 2}),
    "lfm3": ("lfm3", {}),
    "kimi_linear": ("kimi_linear", {}),
    "jamba": ("jamba", {}),
    "mamba": ("mamba", {}),
    "falcon_mamba": ("falcon_mamba", {}),
    "mamba2": ("mamba2", {"n_groups": 2}),
    "nemotron_h": ("nemotron_h", {"n_groups": 2}),
    "bamba": ("bamba", {}),
    "falcon_h1": ("falcon_h1", {}),
}
# Other published types written the same way, not hybrids (``TINY`` is the hybrid list test_autotp,
# test_packing and test_estimate run through)
PUBLISHED_TINY = {
    # Gemma 3 as published for 4B and up: Gemma3ForConditionalGeneration (a SigLIP vision tower, its
    # projector, the Gemma 3 text model in ``model.language_model``), trained on text rows
    "gemma3": ("gemma3", {}),
    # Gemma 4 as published: Gemma4ForConditionalGeneration (a vision tower and its embedder beside the
    # Gemma 4 text model, per-layer input embeddings), its multimodal forward reading the tied
    # embedding's pad row (``runtime/row_reads.py``)
    "gemma4": ("gemma4", {}),
    "gpt_oss": ("gpt_oss", {}),  # per-head attention sinks (s_aux)
}

# tests/test_moe_families.py's models: model type -> sizes set after tiny.py's shrinking (helpers.SEQ is 16
# tokens)
MOE_TINY = {
    "llama4_text": {
        "attention_chunk_size": 8,
        "floor_scale": 8,
        "interleave_moe_layer_step": 2,
        "moe_layers": [1, 3],
    },
    # experts stacked [E * I, H] in a submodule (``DbrxExpertGLU``), viewed by ffn_hidden_size: each split
    # per expert, the width local; as published otherwise (4 experts, top-1, clip_qkv from tiny.py)
    "dbrx": {},
    # fused experts behind one shared MLP; the default config's single expert and top-1 routing as
    # Hunyuan-A13B's 64 experts, top-8, shrunk (4, top-2)
    "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2},
    # a normed embedding (``embed_norm(lookup)``): vocabulary-parallel, the rows summed over TP before its norm
    # (``runtime/embedding.py``); fused routed experts beside shared experts run on every token
    "inkling_text": {},
    # Doge-MoE (``is_moe``; the published default is dense): its experts, rows of two embeddings, kept whole on
    # every rank with their router, its shared MLP split column/row
    "doge": {"is_moe": True},
}
# tests/test_router_jitter.py's models: model type -> the config changed from the type's tiny defaults (Phi-MoE's
# jitter is on as published)
JITTER_TINY = {"phimoe": {}, "mixtral": {"router_jitter_noise": 0.1}}
# Every config the tests change from a type's tiny defaults, named by type and overrides: scripts/plan_sweep.py
# plans these beside the types' defaults (a plan search regression can show only under a test's overrides, as
# Doge-MoE's did while the sweep planned the defaults alone)
TEST_VARIANTS = {
    f"{t} ({', '.join(f'{k}={v}' for k, v in o.items())})": (t, o)
    for t, o in [*TINY.values(), *PUBLISHED_TINY.values(), *MOE_TINY.items(), *JITTER_TINY.items()]
    if o
}


def write_tiny_config(path: str, model_type: str, overrides: dict | None = None, round_trip: bool = False) -> str:
    """scripts/tiny.py's tiny config of ``model_type`` with ``overrides`` set, written to ``path`` (config.json
    only: random init). ``round_trip`` rebuilds it through ``from_dict`` first, so values derived in the
    config's ``__init__`` follow the overrides."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from tiny import tiny_config

    config = tiny_config(model_type)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    if round_trip:
        config = type(config).from_dict(config.to_dict())
    config.save_pretrained(path)
    return path


def write_tiny_dir(path: str, name: str) -> str:
    """``TINY[name]`` (or ``PUBLISHED_TINY[name]``) written to ``path`` (config.json only: random init)."""
    model_type, overrides = {**TINY, **PUBLISHED_TINY}[name]
    return write_tiny_config(path, model_type, overrides, round_trip=True)


def write_family_dir(path: str, family: str, **overrides) -> str:
    os.makedirs(path, exist_ok=True)
    family_config(family, **overrides).save_pretrained(path)
    return path
