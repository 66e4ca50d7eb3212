"""Configs as published: a representative subset of ``make matrix`` (docs/compatibility.md).

Tiny models from each type's own transformers config defaults (``scripts/tiny.py``), only
sizes shrunk. ``shardlm plan`` never shows a traceback: it makes a plan (keeping replicated
the sub-blocks that cannot be split, with the reason) or refuses in one line naming the module.
Accepted plans train at tp=2 exactly like one process (ten of them, in one spawn).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from families import write_tiny_config
from helpers import assert_parity, plain_reference, run_ranks, shardlm_losses

# name -> (model type, overrides of its defaults)
MODELS = {
    "gpt2_pad": ("gpt2", {"pad_token_id": 0}),  # `pad_token_id in input_ids` asked of meta
    "gemma4_text": ("gemma4_text", {}),  # per-layer head_dim (config.head_dim raises)
    "codegen": ("codegen", {}),  # qkv fused in mp_num groups: each rank its whole groups (test_attention_split.py)
    "bloom": ("bloom", {}),  # ALiBi slopes per head: each rank its heads' (test_attention_split.py)
    "falcon_mq": ("falcon", {"multi_query": True, "new_decoder_architecture": False}),
    "gpt_bigcode": ("gpt_bigcode", {"multi_query": True}),
    "lfm2_conv": ("lfm2", {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1], "num_hidden_layers": 2}),
    "cpmant": ("cpmant", {}),  # kept-replicated modules make plain tensors of their own (position buckets)
    "xlm": ("xlm", {}),  # the embeddings' norm output is modified in place (`tensor *= mask`)
    "roc_bert": ("roc_bert", {}),  # the LM-head bias is also `cls.predictions.bias`: one tensor after TP
    "diffllama": ("diffllama", {}),  # exp(sum(lambda_q1 * lambda_k1)) scales split heads: summed over TP
    "hrm_text": ("hrm_text", {}),  # the model's own initial state around split layers: replicate_own
    "rwkv": ("rwkv", {}),  # block 0's time_decay/time_first split with the channels of its key (per_channel)
}
# what `shardlm plan --tp 2` says: (exit code, text in its output, a linear it keeps replicated)
EXPECT = {
    "gpt2_pad": (0, "packed transformer.h.0.attn.c_attn", None),
    "gemma4_text": (0, "model.layers.0.self_attn.q_proj", "model.layers.*.per_layer_input_gate"),
    "codegen": (
        0,
        "widths kept whole (each rank views its columns into whole groups, or sizes a whole input by them): "
        "transformer.h.*.attn.embed_dim=64",
        None,
    ),
    # split by heads (tests/test_attention_split.py): ALiBi sliced per rank; multi-query: q split, k/v computed by all
    "bloom": (0, "sliced to each rank's heads (at their global index): transformer.h.*.self_attention(alibi)", None),
    "falcon_mq": (0, "packed transformer.h.0.self_attention.query_key_value: parts [64, 16, 16], rows shared", None),
    "gpt_bigcode": (0, "packed transformer.h.0.attn.c_attn: parts [64, 16, 16], rows shared by ranks", None),
    # the short conv over the x third of in_proj follows its channels (parallel/infer/layouts.py): nothing kept whole
    "lfm2_conv": (0, "packed model.layers.0.conv.in_proj: parts [64, 64, 64], each split 2 ways", None),
    # its position bias, looked up in a parameter table once per forward, sliced to each rank's heads in every block
    "cpmant": (0, "gradients summed over TP: cpmant.position_bias.relative_attention_bias", None),
    "xlm": (0, "transformer.layer_norm_emb", None),
    "roc_bert": (0, "cls.predictions.decoder", None),
    "diffllama": (
        0,
        "gradients summed over TP: model.layers.*.self_attn.lambda_k1, model.layers.*.self_attn.lambda_k2",
        None,
    ),
    "hrm_text": (0, "replicate_own", None),
    # every block's WKV mixer split by channels and its feed-forward key/value column/row; the feed-forward's
    # receptance, whose output is added to the whole residual stream (a misfit, infer/checks.py), stays whole (the later
    # blocks were kept whole too until the trace told a wrong split's echoes from their cause, Gemma 3n's round)
    "rwkv": (0, "time_decay split with the output channels of key", "rwkv.blocks.*.feed_forward.receptance"),
    # split by channels (parallel/infer/summed.py): x_proj row-parallel in the middle, dt_proj used directly
    "mamba": (0, "its output, read back inside the split channels, has its gradient summed over TP", None),
    # its in_proj cut into [z, x|B|C, dt] and x|B|C again after the conv: packed by both cuts; at n_groups=1
    # B and C (summed over their state dim) are held whole on every rank, the gated norm all-reduces its
    # sum of squares; ``self.lm_head.weight.dtype`` in its LM forward is metadata, not a use of the weight
    "mamba2": (0, "packed backbone.layers.0.mixer.in_proj: parts [128, 128, 8, 8, 8], rows shared by ranks", None),
    "mixtral": (0, "model.layers.0.mlp.experts", None),  # fused experts: the `experts` style (test_moe.py)
    # experts as per-expert linear modules (JetMoE): its MLP split per expert (infer/expert_layers.py), its mixture
    # of attention heads (called through map/reduce) split by its attention layer; the routers kept whole
    "jetmoe": (0, "probed: weight dim 1 in 2 parts", "model.layers.*.self_attention.experts.router.layer"),
}


def _write(root: Path, name: str) -> str:
    model_type, overrides = MODELS.get(name, (name, {}))  # round trip: layer types, kv heads re-derived
    return write_tiny_config(str(root / name), model_type, overrides, round_trip=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    return {name: _write(root, name) for name in EXPECT}


@pytest.mark.sweep
def test_plan_makes_or_refuses_in_one_line_never_a_traceback(dirs, capsys, monkeypatch):
    from shardlm.cli import main

    for name, (code, text, replicated) in EXPECT.items():
        assert main(["plan", dirs[name], "--tp", "2"]) == code, (name, capsys.readouterr())
        out, err = capsys.readouterr()
        if code:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and text in lines[0] and "parallel.fsdp trains it" in lines[0], (name, err)
            continue
        kept = [line for line in out.splitlines() if line.startswith("kept replicated")]
        assert text in out and not err.strip(), (name, out, err)
        assert (
            any(f" {replicated}," in f"{line}," or f" {replicated}:" in line for line in kept)
            if replicated
            else (not kept)
        ), (name, kept)
    # anything the trace does not expect becomes one line naming the running module
    from shardlm.parallel.infer import autotp, trace

    forward = trace.meta_forward

    def boom(meta, *shape):
        meta.model.layers[0].self_attn.register_forward_pre_hook(lambda *a: 1 / 0)
        forward(meta, *shape)

    monkeypatch.setattr(trace, "meta_forward", boom)
    monkeypatch.setattr(autotp, "PLANS", {})  # traced again, not taken from this process's plans
    assert main(["plan", dirs["gemma4_text"], "--tp", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "model.layers.0.self_attn (Gemma4TextAttention): tracing the tensor-parallel" in lines[0]
    assert "ZeroDivisionError" in lines[0] and "parallel.fsdp trains it" in lines[0], lines


# trained in the spawn (a model costs ~5-10 s there on 2 cores); Gemma 4 and GPT-BigCode train
# with parity in `make matrix` (docs/compatibility.md), here only their plans are checked
TRAINED = ["gpt2_pad", "codegen", "bloom", "falcon_mq", "lfm2_conv"]
TRAINED += ["cpmant", "xlm", "roc_bert", "diffllama", "hrm_text"]  # local tensors, shared bias, lambdas summed
TRAINED += ["rwkv"]  # channels of its WKV mixer split (parallel/infer/channels.py)


@pytest.mark.ranks
def test_published_configs_train_at_tp2_like_one_process(dirs):
    paths = [dirs[name] for name in TRAINED]
    got = run_ranks(shardlm_losses, 2, paths, {"tp": 2}, 4, 1, 3)
    for name, path in zip(TRAINED, paths):
        assert_parity(got[path], plain_reference(path, 4, steps=3), label=name)
