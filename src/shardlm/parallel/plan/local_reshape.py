"""Reshapes of a split attention's heads' output to the whole width its forward reads off its input.

TrOCR's attention takes ``embed_dim`` from ``hidden_states.size()`` (a local variable, no attribute
``localize_geometry`` could set) and reshapes its heads' output to it before ``out_proj``:
``attn_output.reshape(bsz, tgt_len, embed_dim)`` (ProphetNet's n-gram self-attention alike, with its
``hidden_size``). A rank holds its heads only, ``embed_dim / tp`` wide, so that reshape asks for ``tp``
times the elements it has. Within such a module (``Plan.local_reshapes``: module -> that whole width,
found by the dry run: ``infer/dry_run.py``) a reshape or view whose last size is the whole width and
whose sizes hold exactly ``tp`` times the tensor's elements is asked for the rank's share instead: the
same heads in the same order, as one process lays them out. Applied by the builder and by the dry run
alike, so it belongs to the plan.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from shardlm.parallel.plan.plan import Plan

_RESHAPES = {"reshape", "view"}
# the error a reshape to the whole width raises at one rank's shapes (torch's message)
_INVALID = re.compile(r"shape '\[([-\d, ]+)\]' is invalid for input of size (\d+)")


class _LocalReshape(TorchFunctionMode):
    """Reshapes to ``whole`` columns of a tensor holding a rank's ``whole / tp`` ask for its share."""

    def __init__(self, whole: int, tp: int) -> None:
        super().__init__()
        self.whole, self.tp = whole, tp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RESHAPES and len(args) >= 2 and isinstance(args[0], torch.Tensor):
            sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
            if all(isinstance(s, int) for s in sizes) and self.asks_whole(tuple(sizes), args[0].numel()):
                args = (args[0], (*sizes[:-1], self.whole // self.tp))
        return func(*args, **kwargs)

    def asks_whole(self, sizes: tuple[int, ...], numel: int) -> bool:
        """``sizes`` end in the whole width and hold ``tp`` times ``numel`` elements (no ``-1`` to infer)."""
        return bool(sizes) and sizes[-1] == self.whole and -1 not in sizes and math.prod(sizes) == numel * self.tp


def reshape_locally(model: nn.Module, plan: Plan, tp: int) -> None:
    """Run every module of ``plan.local_reshapes`` under ``_LocalReshape`` (see the module docstring)."""
    for fqn, whole in plan.local_reshapes.items():
        module = model.get_submodule(fqn)
        forward = module.forward

        def local(*args, forward=forward, whole=whole, **kwargs):
            with _LocalReshape(whole, tp):
                return forward(*args, **kwargs)

        module.forward = local


def asks_whole_width(message: str, whole: int, tp: int) -> bool:
    """Whether ``message`` (an exception's) is a reshape to ``whole`` columns of a tensor ``tp`` times
    smaller: what ``_LocalReshape`` answers."""
    found = _INVALID.search(message)
    if found is None:
        return False
    sizes = tuple(int(s) for s in found.group(1).split(","))
    return _LocalReshape(whole, tp).asks_whole(sizes, int(found.group(2)))
