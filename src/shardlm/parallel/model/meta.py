"""The model's structure on the meta device: from a model directory (``build_meta_model``, fp32
master weights; a config transformers cannot build is the user's error) or as a fresh copy of a
built model's architecture (``build_meta``, the trace's), and its repeated decoder blocks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from shardlm.errors import ConfigError


@contextmanager
def _params_on_meta():
    """Create parameters on the meta device but keep buffers real (rotary ``inv_freq`` etc.),
    so nothing model-sized is allocated and no buffer needs recomputing afterwards."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def load_model_config(model_path: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config.use_cache = False
    return config


def build_meta_model(model_path: str) -> nn.Module:
    """The model's structure with parameters on the meta device (fp32 master weights)."""
    from transformers import AutoModelForCausalLM

    config = load_model_config(model_path)
    try:
        with _params_on_meta():
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build: the user's model directory
        detail = " ".join(str(exc).split())[:200]
        raise ConfigError(
            f"model: transformers cannot build a causal LM from '{model_path}/config.json' "
            f"({type(exc).__name__}: {detail})"
        ) from None
    return model.float()


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks: the longest ModuleList whose children share one class."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            if len({type(m) for m in module}) == 1:
                best = list(module)
    return best


def build_meta(model: nn.Module, eager: bool = True) -> nn.Module:
    """A fresh meta copy of ``model``'s architecture (``eager``: eager attention, every op visible;
    else the attention the ranks will run)."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    if eager:
        config._attn_implementation = "eager"
    # MoE: the eager experts loop (grouped_mm cannot run on meta; every kernel computes the same)
    config._experts_implementation = "eager"
    with torch.device("meta"):
        meta = type(model)._from_config(config)
    # parameters made by legacy constructors (XLNet's ``nn.Parameter(torch.FloatTensor(...))``) ignore the
    # default device and come out on the CPU: the trace would meet meta and CPU tensors in one op
    if any(not p.is_meta for p in meta.parameters()):
        meta.to("meta")
    return meta
