"""The model's property behind a sub-block kept whole, where the trace's own reason is only the symptom.

The trace and the dry run name what broke (a shape error at one rank's shapes, a per-head tensor not
split with the heads); that is where it showed, not why the model's code cannot be split there. For
the sub-blocks whose property is known from the model's code, ``Plan.replicated`` says that property
instead, in one line (the matrix's "kept whole" column, ``plan/kept_whole.py``). Keyed by the class of
the module holding the sub-block (``"Class"``: everything kept whole under it; ``"Class.child"``: that
child only).
"""

from __future__ import annotations

import torch.nn as nn

from shardlm.parallel.infer.indexer import is_indexer, is_qsa_indexer

_INDEXER = "one key head; the weighted scores of all its heads summed before a top-k over tokens"

_PER_LAYER_INPUT = ("per_layer_input_gate", "per_layer_projection")  # Gemma 3n's and Gemma 4's

_INDEXER_KEY = "the indexer's one key head, read by all its query heads"

# Qwen4-Exp's QSA indexer, whole where tp does not divide its query heads (``infer/indexer.py`` splits them otherwise)
_QSA = "one key head fused with its query heads; the scores of all its heads summed before a top-k over blocks"

PROPERTIES = {
    # DeepSeek-V4's CSA compressor's indexer (``infer/shared_kv.py``): computed whole beside the shared key=value head
    "DeepseekV4Indexer": "the compressor's indexer: its heads' scores summed before a top-k, no gradient reaching it",
    # the predicting streams' bias (``get_predict_relative_pos_embeddings``): the projection's rows laid out
    # (batch, seq, ngram, heads) are gathered with bucket indices repeated in (ngram, batch, heads, seq) order and
    # read back as (batch, ngram, heads, seq): one process's head h at query t takes head (h * seq + t) % heads'
    # row (a rank holding heads / tp would pair its rows differently); the main stream's pairs each head its own
    "ProphetNetNgramSelfAttention": (
        "the predicting streams' bias pairs each head with another head's row, by the whole head count"
    ),
    **dict.fromkeys(
        [f"{c}.{m}" for c in ("Gemma4TextDecoderLayer", "Gemma3nTextDecoderLayer") for m in _PER_LAYER_INPUT],
        "per_layer_input (whole, with gradients) multiplies the gate's output channel by channel",
    ),
    # Gemma 3n's activation sparsity (layers with activation_sparsity_pattern > 0): gaussian top-k keeps the
    # gate's outputs above mean + std * icdf(sparsity), both over the whole intermediate width, computed inline
    # by the MLP's forward (torch.mean, torch.std), not by a norm module ``sharded_norm`` could place
    "Gemma3nTextMLP": "activation sparsity: a cutoff from the mean and std of the gate's output over its whole width",
    # AltUp's extra streams: projections of the embedding (and, at the end, back) rescaled by the model's forward
    # to the embedding's magnitude: a root mean square over the whole hidden width, computed inline
    **{
        f"Gemma3nTextModel.{name}.{i}": "AltUp's streams rescaled in the model's forward to the embedding's RMS "
        "over the whole hidden width"
        for name in ("altup_projections", "altup_unembed_projections")
        for i in range(16)
    },
    # parameters another module's forward reads directly, kept whole (``direct_reads.py``)
    **dict.fromkeys(
        ("Gemma3nTextDecoderLayer.altup", "Gemma3nTextAltUp"),
        "AltUp, run by the decoder layer itself (predict, correct), mixes whole copies of the residual stream",
    ),
    **dict.fromkeys(
        ("ProphetNetDecoder.position_embeddings", "ProphetNetDecoder.ngram_embeddings"),
        "the decoder reads the tables itself: positions + 1 for its predicting streams, n-gram rows by index",
    ),
}


def model_property(model: nn.Module, fqn: str) -> str | None:
    """The property (``PROPERTIES``) of the nearest module holding ``fqn`` whose class is listed, else None."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, -1, -1):
        holder = model.get_submodule(".".join(parts[:i]))
        owner, below = type(holder).__name__, ".".join(parts[i:])
        if is_indexer(holder):
            # DeepSeek Sparse Attention's indexer, found by its structure: its one key head, whole on every rank;
            # all of it where tp does not divide its query heads (``infer/indexer.py`` splits them otherwise)
            return _INDEXER_KEY if below == "wk" else _INDEXER
        if is_qsa_indexer(holder):
            return _QSA
        for key in (f"{owner}.{below}", owner):
            if key in PROPERTIES:
                return PROPERTIES[key]
    return None
