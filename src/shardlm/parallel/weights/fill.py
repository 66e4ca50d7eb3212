"""Filling the allocated local pieces of a parallelized model: from the checkpoint's safetensors
(``load_hf_weights``, through ``weights/published.py``) or from a seed (``init_from_seed``, block by
block through ``weights/seeded_init.py``, the whole model on rank 0 where that cannot be), and the
plain one-process model those values equal (``reference_model``).
"""

from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from shardlm.distributed.shards import fill_from_full
from shardlm.parallel.model.adapters import hf_key
from shardlm.parallel.model.hf import tied_keys
from shardlm.parallel.model.meta import build_meta_model, decoder_blocks, load_model_config
from shardlm.parallel.weights import published
from shardlm.parallel.weights.seeded_init import UnwrittenInit, seeded_state


def restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    for name, buf in model.named_buffers():
        if name in buffers:
            buf.copy_(buffers[name])


def _base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{HF key: tensor}`` of everything an HF checkpoint holds: tied duplicates, LoRA adapters
    and ``modules_to_save`` copies left out, peft's ``base_layer``/``original_module`` unwrapped."""
    tied = tied_keys(model)
    state = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        hf = hf_key(key)
        if key not in tied and hf is not None:
            state[hf] = tensor
    return state


def load_hf_weights(model: nn.Module, model_path: str) -> None:
    """Read safetensors shard by shard into the local pieces of every (D)Tensor (DCP's HF reader):
    each rank reads only its own rows, a packed projection's parts included (``distributed/shards.py``), the
    checkpoint's names and merged/concatenated tensors mapped by transformers' rules (``weights/published.py``)."""
    published.load(_base_state(model), model_path, build_meta_model(model_path))


def init_from_seed(model: nn.Module, model_path: str, seed: int) -> None:
    """Random init that is identical for every layout and never whole on one rank: every rank
    draws the model's own init one decoder block at a time (``parallel/weights/seeded_init.py``) and keeps its
    piece of each tensor (``local_piece`` knows every placement, packed ones too)."""
    # parameters only: buffers keep the values they were built with (``restore_buffers``)
    targets = {k: v for k, v in _base_state(model).items() if isinstance(v, nn.Parameter)}
    try:
        meta = build_meta_model(model_path)
        aliases = _aliases(meta)
        filled = set()
        for drawn, tensor in seeded_state(meta, decoder_blocks(meta), seed):
            for key in aliases.get(drawn, [drawn]):  # a shared weight is drawn under one of its names
                if key in targets:
                    fill_from_full(targets[key], tensor)  # the piece is cut on the CPU, then copied over
                    filled.add(key)
    except UnwrittenInit as exc:
        if dist.get_rank() == 0:
            print(f"random init: {exc}; building the whole model on rank 0 instead", flush=True)
        _init_from_whole_model(targets, model_path, seed)
        return
    # persistent buffers (MoE routing's e_score_correction_bias) keep the meta build's values (restore_buffers)
    unfilled = sorted(k for k, t in targets.items() if k not in filled and isinstance(t, nn.Parameter))
    if unfilled:
        raise RuntimeError(f"random init drew no value for {unfilled[0]}")


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter registered under several names (tied weights) -> all its names."""
    names: dict[int, list[str]] = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(key)
    return {key: keys for keys in names.values() if len(keys) > 1 for key in keys}


def _init_from_whole_model(targets: dict[str, torch.Tensor], model_path: str, seed: int) -> None:
    """The fallback: rank 0 builds the model from ``torch.manual_seed(seed)``, tensor by tensor it
    is broadcast and every rank keeps its piece."""
    full = _whole_seeded_model(model_path, seed).state_dict() if dist.get_rank() == 0 else {}
    for key, target in targets.items():
        tensor = full[key] if dist.get_rank() == 0 else torch.empty(target.shape, dtype=target.dtype)
        tensor = tensor.to(device=target.device, dtype=target.dtype)
        if dist.get_world_size() > 1:
            dist.broadcast(tensor, src=0)
        fill_from_full(target, tensor)


def _whole_seeded_model(model_path: str, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(load_model_config(model_path)).float()


@torch.no_grad()
def reference_model(model_path: str, seed: int) -> nn.Module:
    """The plain one-process model shardlm starts from (also what tests compare against): the
    same values ``init_from_seed`` gives every layout."""
    model = _whole_seeded_model(model_path, seed)
    try:
        meta = build_meta_model(model_path)
        for key, tensor in seeded_state(meta, decoder_blocks(meta), seed):
            model.get_parameter(key).copy_(tensor)  # a tied weight: under whichever name it was drawn
    except UnwrittenInit:
        return _whole_seeded_model(model_path, seed)
    return model


def has_weights(model_path: str) -> bool:
    return bool(glob.glob(os.path.join(model_path, "*.safetensors")))
