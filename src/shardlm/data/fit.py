"""Whether the data fits the model: token ids inside its vocabulary, ``data.seq_len`` inside its
positions; and loading the tokenizer without ever sending a local-looking path to the hub.

Why: an id at or above ``vocab_size`` has no embedding row. At one process the embedding lookup
dies with an IndexError deep in a rank; at tp > 1 the vocabulary-parallel embedding masks ids
outside every rank's range to zero rows and trains on garbage with exit 0. A ``seq_len`` beyond
the model's positions fails in GPT-2's position embedding (IndexError) and runs silently past a
rotary model's trained range. Both are answered by one ``ConfigError`` naming the numbers, the
same at every layout: in the launcher (``shardlm.preflight``) against the tokenizer and the built
data set, and again by the trainer against the samples it is handed (``check_ids``).
"""

from __future__ import annotations

import torch

from shardlm.config.paths import looks_local
from shardlm.errors import ConfigError

# config attributes that bound the positions a model can embed, in the order transformers' models use them
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def load_tokenizer(cfg):
    """The tokenizer of ``cfg`` (``tokenizer``, default the model directory); a local-looking path
    is read with ``local_files_only`` so a missing file is an error, never a hub request."""
    from transformers import AutoTokenizer

    where = cfg.tokenizer or cfg.model
    return AutoTokenizer.from_pretrained(where, local_files_only=looks_local(where))


def model_config(model_path: str):
    """The model directory's ``config.json`` as transformers reads it (already checked to exist)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def text_config(model_config):
    """The decoder's config (a multimodal config keeps it in ``text_config``)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def vocab_size(model_config) -> int | None:
    return getattr(text_config(model_config), "vocab_size", None)


def max_positions(model_config) -> tuple[str, int] | None:
    """(its name in config.json, value) of the positions the model can embed; None when it has no
    such bound (Mamba). transformers maps ``max_position_embeddings`` to GPT-2's ``n_positions``."""
    config = text_config(model_config)
    aliases = getattr(config, "attribute_map", {}) or {}
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return aliases.get(key, key), value
    return None


def check_seq_len(model_config, seq_len: int, name: str = "data.seq_len") -> None:
    """``seq_len`` tokens per sample fit the model's positions."""
    bound = max_positions(model_config)
    if bound is not None and seq_len > bound[1]:
        key, value = bound
        raise ConfigError(
            f"{name}={seq_len} exceeds the model's {key}={value} (its config.json): positions beyond it "
            f"have no embedding; set {name} <= {value}"
        )


def check_tokenizer(tokenizer, model_config, where: str) -> None:
    """Every id the tokenizer can produce (``len(tokenizer)``, its special ids) has an embedding row."""
    vocab = vocab_size(model_config)
    if vocab is None:
        return
    special = [i for i in (tokenizer.all_special_ids or []) if i is not None]
    n, top = len(tokenizer), max(special, default=-1)
    if n > vocab or top >= vocab:
        what = f"has {n} ids" if n > vocab else f"has the special id {top}"
        raise ConfigError(
            f"tokenizer: '{where}' {what} but the model's vocab_size is {vocab}: ids >= {vocab} have no "
            f"embedding row; use the model's own tokenizer, or a model with vocab_size >= {max(n, top + 1)}"
        )


def check_ids(input_ids: torch.Tensor, vocab: int, what: str = "data") -> None:
    """Every id of ``input_ids`` lies in ``[0, vocab)`` (a max and a min over the ids: cheap)."""
    if input_ids.numel() == 0:
        return
    top, low = int(input_ids.max()), int(input_ids.min())
    if top >= vocab or low < 0:
        bad = top if top >= vocab else low
        raise ConfigError(
            f"{what}: token id {bad} is outside the model's vocabulary [0, {vocab}): the tokenizer does not "
            "match the model; use the model's own tokenizer"
        )
