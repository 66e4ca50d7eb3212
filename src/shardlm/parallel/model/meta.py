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
    """The repeated decoder blocks: the longest ModuleList whose children are all decoder layers by the
    model's own ``_no_split_modules`` (a hybrid's layers of several kinds: Zamba2's Mamba and hybrid
    layers), else the longest whose children share one class (without the first rule, Zamba2's blocks
    were one shared layer's per-call adapters)."""
    layer_kinds = set(getattr(model, "_no_split_modules", None) or ())
    best: list[nn.Module] = []
    for rule in (lambda kinds: kinds <= layer_kinds and len(kinds) > 1, lambda kinds: len(kinds) == 1):
        for module in model.modules():
            if isinstance(module, nn.ModuleList) and len(module) > len(best):
                if rule({type(m).__name__ for m in module}):
                    best = list(module)
        if best:
            return best
    return best


def shared_modules(blocks: list[nn.Module]) -> list[list[nn.Module]]:
    """Groups of modules, one in each of several blocks, that hold the same (tied) parameters: Zamba's and
    Zamba2's shared transformer, a copy in each hybrid layer with its parameters tied to the others'. FSDP2
    manages a parameter in one group only, so each such set of modules is a group of its own, gathered at
    each call. Per block, the outermost modules whose parameters all sit in other blocks too."""
    blocks_of: dict[int, set[int]] = {}
    for i, block in enumerate(blocks):
        for param in block.parameters():
            blocks_of.setdefault(id(param), set()).add(i)
    groups: dict[frozenset[int], list[nn.Module]] = {}
    for block in blocks:
        inner: set[int] = set()
        for module in block.modules():
            params = {id(p) for p in module.parameters()}
            if id(module) in inner or not params or any(len(blocks_of[p]) < 2 for p in params):
                continue
            inner |= {id(c) for c in module.modules()}
            groups.setdefault(frozenset(params), []).append(module)
    return [modules for modules in groups.values() if len(modules) > 1]


def recomputed_in_backward(block: nn.Module) -> bool:
    """Whether the model reruns the block's layers in its backward from within a custom autograd
    function (reversible residual layers: Reformer's ``backward_pass``), outside any hook of the block's
    own forward: a block resharded after its forward would be rerun on its shards."""
    return callable(getattr(block, "backward_pass", None))


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
