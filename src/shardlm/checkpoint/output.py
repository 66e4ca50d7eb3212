"""What every consolidation shares: output dtypes, the staged output directory, the bit-for-bit
comparison and its message, and the Hugging Face files written next to the weights."""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from contextlib import contextmanager

import torch

from shardlm.checkpoint.layout import HF_FILES
from shardlm.config.paths import TOKENIZER_FILES
from shardlm.errors import OutOfSpace

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
CHECK_MESSAGE = "Save correctness check passed: {n} parameters match the unsharded checkpoint exactly."


class VerificationError(RuntimeError):
    """The written files differ from the checkpoint; the message names the first mismatch."""


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file here (0o666 less the umask, e.g. 0o644)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _plain_modes(folder: str) -> None:
    """Give every file in ``folder`` the mode of any file ``open()`` creates: safetensors'
    ``save_file`` (and so ``save_pretrained``) writes 0o600, unlike the files beside it."""
    mode = default_file_mode()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            os.chmod(path, mode)


@contextmanager
def staged(out: str, needed: int | None = None):
    """A fresh ``OUT.tmp-<id>`` directory to write into: renamed to ``out`` if the block succeeds,
    removed if it fails, so nothing half-written is ever left at ``out``. A full disk becomes one
    ``OutOfSpace`` line naming ``out`` and the ``needed`` bytes (the weights), where known."""
    tmp = f"{os.path.normpath(out)}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        yield tmp
        _plain_modes(tmp)
        os.rename(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "No space left on device" in str(exc):
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(out))).free
            need = f"it needs about {needed / 1e6:.1f} MB, " if needed else ""
            raise OutOfSpace(
                f"no space left on device writing {out}: {need}{free / 1e6:.1f} MB are free there; "
                "free some space or write elsewhere"
            ) from None
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
