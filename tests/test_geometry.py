"""``Geometry``: the model's sizes read once from a config, the head dim derived one way
(``parallel/model/geometry.py``); checked on plain namespaces, no transformers config needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardlm.parallel.model.geometry import Geometry, read_geometry


def test_sizes_under_each_familys_names_and_head_dim_from_hidden_over_heads():
    llama = read_geometry(
        SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                        num_hidden_layers=2, vocab_size=256)
    )  # fmt: skip
    assert (llama.hidden, llama.heads, llama.kv_heads, llama.kv, llama.head_dim) == (64, 4, 2, 2, 16)
    assert (llama.intermediate, llama.layers, llama.vocab) == (128, 2, 256)
    # the vocabulary is not among them: split in torch's chunks, the last rank's shorter (``holds_vocab_rows``)
    assert llama.split_sizes == {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    gpt2 = read_geometry(SimpleNamespace(n_embd=96, n_head=6, n_layer=3, vocab_size=50))
    assert (gpt2.hidden, gpt2.heads, gpt2.kv_heads, gpt2.kv, gpt2.head_dim, gpt2.layers) == (96, 6, None, 6, 16, 3)


def test_a_vocabulary_tp_does_not_divide_is_split_unevenly_and_refused_only_where_a_rank_gets_no_row():
    """GPT-2's published 50257 at tp=2 (25129 and 25128 rows) and an odd tiny one at tp=4 (64, 64, 64, 61) are
    accepted; 9 rows at tp=4 (chunks of 3: 3, 3, 3 and none) leave a rank nothing: one line, the valid tps."""
    from shardlm.errors import ConfigError
    from shardlm.parallel.infer.autotp import check_config_geometry, holds_vocab_rows

    config = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    check_config_geometry(SimpleNamespace(**config, vocab_size=50257), 2)
    check_config_geometry(SimpleNamespace(**config, vocab_size=253), 4)
    assert holds_vocab_rows(50257, 2) and holds_vocab_rows(253, 4) and not holds_vocab_rows(9, 4)
    with pytest.raises(ConfigError) as err:
        check_config_geometry(SimpleNamespace(**config, vocab_size=9), 4)
    assert str(err.value) == (
        "parallel.tp=4 leaves a rank no row of the model's vocab_size=9 (split in chunks of 3 rows); "
        "valid tp values for this model: 1, 2"
    )
    with pytest.raises(ConfigError, match="does not divide the model's num_attention_heads=4"):
        check_config_geometry(SimpleNamespace(**config, vocab_size=253), 3)  # the heads keep their rule


def test_a_head_dim_the_config_names_wins_over_hidden_over_heads():
    geo = read_geometry(SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=32))
    assert geo.head_dim == 32 and geo.head_widths == {32}


class PerLayer(SimpleNamespace):
    """Gemma 4's per-layer config: no single ``head_dim`` (transformers raises), one per layer."""

    @property
    def head_dim(self):
        raise AttributeError("head_dim differs per layer")


def test_per_layer_head_dims_give_every_width_and_the_smallest_as_the_head_dim():
    config = PerLayer(
        hidden_size=64, num_attention_heads=2, per_layer_config=[{"head_dim": 32}, {"head_dim": 16}, {"head_dim": 32}]
    )
    geo = read_geometry(config)
    assert geo.head_widths == {16, 32} and geo.head_dim == 16


def test_a_model_without_attention_heads_has_no_head_dim():
    mamba = read_geometry(SimpleNamespace(hidden_size=64, n_groups=1, chunk_size=8, vocab_size=256))
    assert (mamba.heads, mamba.kv, mamba.head_dim, mamba.head_widths) == (None, None, None, frozenset())
    assert (mamba.ssm_groups, mamba.ssm_chunk) == (1, 8)


def test_geometry_is_frozen():
    with pytest.raises(AttributeError):
        Geometry().hidden = 1
