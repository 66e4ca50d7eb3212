"""What every consolidation shares: output dtypes, the staged output directory, the bit-for-bit
comparison and its message, and the Hugging Face files written next to the weights."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager

import torch

from shardlm.checkpoint.layout import HF_FILES, TOKENIZER_FILES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
CHECK_MESSAGE = "Save correctness check passed: {n} parameters match the unsharded checkpoint exactly."


class VerificationError(RuntimeError):
    """The written files differ from the checkpoint; the message names the first mismatch."""


@contextmanager
def staged(out: str):
    """A fresh ``OUT.tmp-<id>`` directory to write into: renamed to ``out`` if the block succeeds,
    removed if it fails, so nothing half-written is ever left at ``out``."""
    tmp = f"{os.path.normpath(out)}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        yield tmp
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def write_hf_files(step_dir: str, out: str, target: torch.dtype) -> None:
    """The checkpoint's ``hf/`` files into ``out``, ``config.json`` saying the written ``target`` dtype."""
    hf = os.path.join(step_dir, "hf")
    for name in HF_FILES + TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf, name)) and name != "config.json":
            shutil.copy2(os.path.join(hf, name), os.path.join(out, name))
    with open(os.path.join(hf, "config.json")) as fh:
        config = json.load(fh)
    config["dtype"] = DTYPE_NAMES[target]  # the dtype from_pretrained(dtype="auto") will use
    if "torch_dtype" in config:
        config["torch_dtype"] = DTYPE_NAMES[target]
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
