"""A torch-function mode active while one module runs (``while_running``): how the runtime changes a few
named ops inside a model's own forward (DSA's indexer's top-k, ``indexer.py``; XLNet's attention's einsums,
``head_einsums.py``) without rewriting its modeling code."""

from __future__ import annotations

import torch.nn as nn
from torch.overrides import TorchFunctionMode


def while_running(module: nn.Module, mode: TorchFunctionMode) -> None:
    """Enter ``mode`` as ``module``'s forward starts (a pre-hook, after those registered before: a style's
    local views) and leave it as it ends, whether or not it raised."""
    module.register_forward_pre_hook(lambda m, args: _enter(mode))
    module.register_forward_hook(lambda m, args, out: _exit(mode), always_call=True)


def _enter(mode: TorchFunctionMode) -> None:
    mode.__enter__()  # its return value (the mode) would replace the module's arguments


def _exit(mode: TorchFunctionMode) -> None:
    mode.__exit__(None, None, None)
