"""Seeded random init, one unit at a time (``seeded_init.py``): never the whole model at once, the
model's own init recipe, and a fallback that is never silent.

References: the number of parameters materialized at any moment (at most one decoder block's
subtree, or one subtree without blocks); GPT-2's init recipe (std 0.02, its residual
projections 0.02 / sqrt(2 n_layer)); ``torch.manual_seed`` + ``from_config`` for the fallback.
Multi-rank equality with ``reference_model`` is what every parity test starts from.
"""

import math

import torch
from families import family_config

from shardlm.parallel.model.meta import build_meta_model, decoder_blocks
from shardlm.parallel.weights.fill import reference_model
from shardlm.parallel.weights.seeded_init import UnwrittenInit, seeded_state


def model_dir(tmp_path, family: str, **overrides) -> str:
    path = str(tmp_path / family)
    family_config(family, **overrides).save_pretrained(path)
    return path


def test_one_unit_at_a_time_with_the_models_own_recipe(tmp_path):
    path = model_dir(tmp_path, "gpt2", n_layer=4, vocab_size=512)
    meta = build_meta_model(path)
    blocks = decoder_blocks(meta)
    block_size = sum(p.numel() for p in blocks[0].parameters())
    largest_outside = meta.transformer.wte.weight.numel()  # the biggest subtree without a block
    values, most_alive = {}, 0
    for name, tensor in seeded_state(meta, blocks, seed=3):
        alive = sum(p.numel() for p in meta.parameters() if not p.is_meta)
        most_alive = max(most_alive, alive)
        values[name] = tensor.clone()
    assert most_alive <= max(block_size, largest_outside) < sum(values[k].numel() for k in values) / 2
    assert all(p.is_meta for p in meta.parameters())  # every unit was dropped
    std = 0.02 / math.sqrt(2 * 4)
    assert abs(values["transformer.h.2.attn.c_proj.weight"].std().item() - std) < 0.15 * std
    assert abs(values["transformer.h.2.attn.c_attn.weight"].std().item() - 0.02) < 0.1 * 0.02

    def draw(seed: int) -> dict:
        meta = build_meta_model(path)
        return dict(seeded_state(meta, decoder_blocks(meta), seed))

    again, other = draw(3), draw(4)
    assert all(torch.equal(values[k], again[k]) for k in values)
    assert not torch.equal(values["transformer.wte.weight"], other["transformer.wte.weight"])
    ref = reference_model(path, 3)
    assert all(torch.equal(ref.get_parameter(k), values[k]) for k in values if k != "lm_head.weight")
    assert ref.lm_head.weight is ref.transformer.wte.weight  # still tied


def test_an_init_that_leaves_parameters_unwritten_falls_back_to_the_whole_model(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaPreTrainedModel

    path = model_dir(tmp_path, "llama")
    original = LlamaPreTrainedModel._init_weights

    def skips_embeddings(self, module):
        if not isinstance(module, torch.nn.Embedding):
            original(self, module)

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", skips_embeddings)
    meta = build_meta_model(path)
    try:
        list(seeded_state(meta, decoder_blocks(meta), 0))
        raise AssertionError("an unwritten embedding was not caught")
    except UnwrittenInit as exc:
        assert "model.embed_tokens" in str(exc)
    got = reference_model(path, 0).state_dict()  # the fallback: the whole model from torch.manual_seed
    torch.manual_seed(0)
    want = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).float().state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
