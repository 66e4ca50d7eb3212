"""``scripts/tiny.py``: each type's own config defaults shrunk consistently (issue 27). Configs only,
no ranks: the constraints each config validates (or its model assumes) hold after shrinking, one
rule each, and the types that cannot run on text rows say why. ``make matrix`` builds and trains
them all (docs/compatibility.md)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import NOT_BUILDABLE, NotBuildable, tiny_config  # noqa: E402


def test_routing_sizes_agree():
    ernie = tiny_config("ernie4_5_moe")  # top-k stored as moe_k (its attribute_map)
    assert ernie.num_experts_per_tok <= ernie.num_experts
    bailing = tiny_config("bailing_hybrid")  # expert groups stored as num_expert_group
    assert bailing.num_experts % bailing.n_group == 0 and bailing.topk_group <= bailing.n_group
    deepseek = tiny_config("deepseek_v2")  # top-k None by default
    assert isinstance(deepseek.num_experts_per_tok, int) and deepseek.num_experts_per_tok <= deepseek.n_routed_experts
    dots1 = tiny_config("dots1")  # every expert count None by default
    assert (dots1.n_routed_experts, dots1.num_experts_per_tok, dots1.n_shared_experts) == (4, 2, 1)


def test_derived_sizes_stay_derived():
    xlnet = tiny_config("xlnet")
    assert xlnet.d_head * xlnet.n_head == xlnet.d_model
    zamba2 = tiny_config("zamba2")
    assert zamba2.attention_hidden_size == 2 * zamba2.hidden_size
    assert zamba2.hybrid_layer_ids and max(zamba2.hybrid_layer_ids) < zamba2.num_hidden_layers
    mimo = tiny_config("mimo_v2_flash")  # 0.334 of the head dim: an even number of rotary dims
    factor = mimo.rope_parameters["full_attention"]["partial_rotary_factor"]
    assert int(mimo.head_dim * factor) % 2 == 0 and int(mimo.head_dim * factor) > 0
    dory = tiny_config("dory")
    assert dory.n_input_layers + dory.n_recurrent_layers + dory.n_output_layers == dory.num_hidden_layers
    gemma3n = tiny_config("gemma3n_text")  # the cache-sharing layers keep a producer of their kind
    assert gemma3n.kv_sharing_modes and gemma3n.vocab_size_per_layer_input == gemma3n.vocab_size
    assert gemma3n.intermediate_size == [128] * gemma3n.num_hidden_layers  # per-layer widths shrunk too
    ernie_vl = tiny_config("ernie4_5_vl_moe_text")  # text and vision experts' widths (1536, 512): still 3 to 1
    assert ernie_vl.moe_intermediate_size == [192, 64]
    dots3 = tiny_config("dots3_note_text")  # sliding layers' latent (1024 of 5120 published): still narrower
    sliding = dots3.per_layer_config["sliding_attention"]
    assert sliding.kv_lora_rank + sliding.qk_rope_head_dim < dots3.hidden_size


def test_unequal_sizes_keep_what_each_config_needs():
    """The second size set (8 heads, 4 kv heads, hidden 96, intermediate 160) where a rule must bend:
    MLA's kv heads stay its heads (one key per query head, from the latent; Dots 3 validates it per
    layer too), kv heads divide the heads (nanochat's 6), Falcon-H1's SSM heads fill its mamba_d_ssm,
    and a head derived as hidden / heads (StableLM) or set (Qwen3.5) keeps even rotary dims."""
    for model_type in ("deepseek_v3", "axk1", "dots3_note_text"):
        mla = tiny_config(model_type, "unequal_even")
        assert mla.num_key_value_heads == mla.num_attention_heads == 8, model_type
    sliding = mla.per_layer_config["sliding_attention"]  # Dots 3's sliding layers' own heads
    assert sliding.num_key_value_heads == sliding.num_attention_heads
    nanochat = tiny_config("nanochat", "unequal_even")
    assert nanochat.num_attention_heads % nanochat.num_key_value_heads == 0 and nanochat.num_key_value_heads % 2 == 0
    falcon = tiny_config("falcon_h1", "unequal_even")
    assert falcon.mamba_n_heads * falcon.mamba_d_head == falcon.mamba_d_ssm == 160
    stablelm = tiny_config("stablelm", "unequal_even")
    head = stablelm.hidden_size // stablelm.num_attention_heads
    assert int(head * stablelm.rope_parameters["partial_rotary_factor"]) % 2 == 0
    qwen = tiny_config("qwen3_5_text", "unequal_even")
    assert int(qwen.head_dim * qwen.rope_parameters["partial_rotary_factor"]) % 2 == 0
    assert tiny_config("deepseek_v3").num_key_value_heads == 4  # the first set as before


@pytest.mark.parametrize("model_type", ["xlstm", "marian", "nemotron"])
def test_builds_and_trains_a_step(model_type):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).float()
    ids = torch.randint(0, 64, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_not_buildable_says_why():
    for model_type, reason in NOT_BUILDABLE.items():
        with pytest.raises(NotBuildable, match="^" + re.escape(reason[:30])):
            tiny_config(model_type)
