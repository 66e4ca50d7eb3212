"""The config's paths, checked before anything is spawned: the model directory, the tokenizer's,
and ``train.output_dir`` (a directory that can be created and written).

Why here: a path that cannot work otherwise fails in every rank with a traceback (a read-only
output_dir), or worse reaches the Hugging Face hub (a typo in a local path gets half a minute of
network retries and then "Repo id must be ..."). shardlm reads local model directories only; a
tokenizer may be a hub id, but a path that looks local never goes to the hub (``looks_local``).
"""

from __future__ import annotations

import glob
import os

from shardlm.errors import ConfigError

# weights transformers writes in formats shardlm does not read (it reads ``*.safetensors`` only)
OTHER_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "tf_model.h5", "flax_model.msgpack", "*.safetensors.index.json")

# files one of which a directory needs for ``AutoTokenizer`` to load a tokenizer from it
TOKENIZER_VOCAB = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
# every file of a tokenizer (a checkpoint's ``hf/`` copies these, ``checkpoint/layout.py``)
TOKENIZER_FILES = (
    *TOKENIZER_VOCAB,
    "special_tokens_map.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub repo id (``org/name``): it exists, starts with ``/``,
    ``.`` or ``~``, or has more separators than a repo id's one slash."""
    return (
        os.path.exists(path)
        or path.startswith(("/", ".", "~"))
        or path.count("/") > 1
        or (os.sep != "/" and os.sep in path)
    )


def check_model_dir(path: str, key: str = "model") -> None:
    """``path`` is a local Hugging Face model directory (``config.json``; weights are optional:
    a config-only directory trains from a seeded random init, but weights only in a format shardlm
    does not read, or a safetensors index without its shards, mean weights were expected)."""
    if not path:
        raise ConfigError(f"config key '{key}' is required: a Hugging Face model directory")
    if not os.path.isdir(path):
        raise ConfigError(
            f"{key}: '{path}' is not a directory with a config.json; shardlm reads a local Hugging Face model "
            "directory (download a hub model first, e.g. `hf download ORG/NAME --local-dir DIR`)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}: '{path}' has no config.json; point '{key}' at a Hugging Face model directory")
    if not glob.glob(os.path.join(path, "*.safetensors")):  # a random init, unless weights were meant
        other = sorted(os.path.basename(f) for pattern in OTHER_WEIGHTS for f in glob.glob(os.path.join(path, pattern)))
        if other:
            raise ConfigError(
                f"{key}: '{path}' has {', '.join(other[:3])} but no .safetensors weights, so it would train from a "
                "random init; shardlm reads safetensors only: add the .safetensors files (or convert the weights), "
                "or remove these files to train from scratch"
            )


def check_tokenizer_path(model: str, tokenizer: str | None) -> None:
    """The tokenizer's directory exists and has tokenizer files (a hub id is left to the loader)."""
    if tokenizer is not None:
        if looks_local(tokenizer) and not os.path.isdir(tokenizer):
            raise ConfigError(
                f"tokenizer: '{tokenizer}' is not a directory; point it at a tokenizer directory "
                "or remove the key to use the model directory's tokenizer"
            )
        if not looks_local(tokenizer):
            return
    where = tokenizer or model
    if not any(os.path.isfile(os.path.join(where, f)) for f in TOKENIZER_VOCAB):
        whose = "tokenizer" if tokenizer else "model"
        raise ConfigError(
            f"{whose}: '{where}' has no tokenizer files ({', '.join(TOKENIZER_VOCAB)}); a config-only model "
            "directory trains from a random init but still needs a tokenizer: set 'tokenizer' to a tokenizer directory"
        )


def nearest_existing(path: str) -> str:
    """``path`` or its closest ancestor that exists (what creating ``path`` would write into)."""
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_output_dir(path: str) -> None:
    """``train.output_dir`` is a directory, or can be created, and can be written."""
    if not path:
        raise ConfigError("config key 'train.output_dir' is required: a directory for checkpoints and logs")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"train.output_dir: '{path}' is a file, not a directory; choose another train.output_dir")
    base = nearest_existing(path)
    if not os.path.isdir(base):
        raise ConfigError(f"train.output_dir: '{base}' is a file, so '{path}' cannot be created; choose another path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(
            f"train.output_dir: '{base}' is not writable (read-only filesystem or no permission); "
            "choose a writable train.output_dir"
        )
