"""LoRA checkpoint -> a peft adapter directory (or, with ``--merge``, a merged Hugging Face model).

A LoRA checkpoint holds only what trained (``lora_A``/``lora_B`` of every adapted layer, and the
``modules_to_save`` copies) plus the peft config in its marker. The adapter directory is what
``PeftModel.save_pretrained`` writes: ``adapter_config.json`` and ``adapter_model.safetensors``
under peft's keys (``base_model.model.<module>.lora_A.weight``). Every tensor is read whole
from the DCP shards (packed projections' ``lora_B`` is stored in HF row order, so nothing is
averaged or permuted) and written once; the files are re-read and compared bit for bit before
the directory is renamed into place.

``--merge``: the base model (``model`` of the run's config, or its seeded random init when that
directory has no weights) is loaded on one process, the adapter applied with peft and merged
(``merge_and_unload``), and the result saved with ``save_pretrained`` and verified against the
merged tensors in memory.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from shardlm.checkpoint.io import load_dcp, read_metadata
from shardlm.checkpoint.output import CHECK_MESSAGE, VerificationError, same_bits, staged, write_hf_files
from shardlm.errors import ConfigError
from shardlm.parallel.runtime import lora
from shardlm.parallel.weights.fill import has_weights, reference_model


def read_adapter(step_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{peft key: full tensor}`` of every trained tensor in the checkpoint."""
    metadata = read_metadata(step_dir)
    items = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in items.items()}
    load_dcp(state, step_dir, no_dist=True)
    return {lora.peft_key(k[len("model.") :]): v.to(dtype).contiguous() for k, v in state.items()}


def _write_adapter(step_dir: str, out: str, marker: dict, dtype: torch.dtype) -> int:
    tensors = read_adapter(step_dir, dtype)
    config = dict(marker["lora"])
    config.update(base_model_name_or_path=marker["config"]["model"], inference_mode=True)
    with open(os.path.join(out, lora.CONFIG_FILE), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(out, lora.WEIGHTS_FILE), metadata={"format": "pt"})
    written = load_file(os.path.join(out, lora.WEIGHTS_FILE))
    if set(written) != set(tensors):
        raise VerificationError(f"'{sorted(set(written) ^ set(tensors))[0]}' is missing from or extra in the adapter")
    for name, tensor in tensors.items():
        if not same_bits(written[name], tensor):
            raise VerificationError(f"'{name}' in {lora.WEIGHTS_FILE} differs from the checkpoint")
    return len(tensors)


def _base_model(marker: dict):
    """The run's base model on one process, as training started from it."""
    path = marker["config"]["model"]
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--merge: the base model '{path}' of this run is gone; restore it or drop --merge")
    if has_weights(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return reference_model(path, marker["config"]["train"]["seed"])


def _write_merged(adapter_dir: str, out: str, marker: dict, dtype: torch.dtype) -> int:
    merged = PeftModel.from_pretrained(_base_model(marker), adapter_dir).merge_and_unload()
    merged = merged.to(dtype)
    merged.save_pretrained(out)
    state = revert_weight_conversion(merged, merged.state_dict())  # the names save_pretrained wrote
    count = 0
    for file in sorted(f for f in os.listdir(out) if f.endswith(".safetensors")):
        with safe_open(os.path.join(out, file), "pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                if not same_bits(fh.get_tensor(name), state[name].contiguous()):
                    raise VerificationError(f"'{name}' in {file} differs from the merged model")
                count += 1
    return count


def consolidate_lora(step_dir: str, marker: dict, out: str, dtype: torch.dtype, merge: bool) -> int:
    """Write the adapter (or the merged model) of ``step_dir`` to ``out``; returns tensors verified."""
    if not merge:
        with staged(out) as tmp:
            count = _write_adapter(step_dir, tmp, marker, dtype)
    else:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out))) as adapter_dir:
            _write_adapter(step_dir, adapter_dir, marker, torch.float32)
            with staged(out) as tmp:
                count = _write_merged(adapter_dir, tmp, marker, dtype)
                write_hf_files(step_dir, tmp, dtype)
    print(CHECK_MESSAGE.format(n=count), flush=True)
    return count
