"""Modules whose forward depends on tensor values, kept whole and run on real CPU tensors during the trace.

The trace runs on meta tensors, which hold no data. Most questions a modeling file asks of values have an
answer without data (``meta_answers.py``), but some ops have no shape without data: a boolean mask's rows
(``x[mask]``, whose meta kernel calls ``nonzero``), BLT's patch lengths from entropies, XMOD's per-language
adapters. Such a module is *kept whole*: its linears stay replicated on every rank (``Plan.replicated``,
with this reason) and, in every later trace and in the dry run, its forward runs on a real CPU copy of it
(``materialize``: small random parameters, the model's own buffers) with its inputs made real (zeros) and
its outputs moved back to meta (``run_whole``). What it reads split is a violation like any other (the
sub-block feeding it stays replicated): it computes on whole tensors only.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

# what torch's meta kernels say when an op's output shape depends on the data (``nonzero``, masked indexing)
_DATA_DEPENDENT = ("data-independent", "data-dependent", "nonzero")

WHY = "its forward depends on tensor values (a boolean mask's rows), run whole"


def depends_on_values(exc: BaseException) -> bool:
    """Whether ``exc`` is a meta kernel refusing an op whose output shape depends on the data."""
    return isinstance(exc, (NotImplementedError, RuntimeError)) and any(s in str(exc) for s in _DATA_DEPENDENT)


def materialize(module: nn.Module, seed: int = 0) -> nn.Module:
    """A CPU copy of ``module`` (meta parameters or real), parameters small and random (their values
    only steer data-dependent choices, whose shapes are what the trace needs), buffers the model's own
    where they are real, zeros where they are meta."""
    real = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(seed)
    for sub in real.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                data = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02
                sub._parameters[name] = nn.Parameter(data.to(p.dtype), requires_grad=False)
        for name, b in sub._buffers.items():
            if b is not None and b.is_meta:
                sub._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
    return real.eval()


def _to_cpu(t):
    if isinstance(t, torch.Tensor) and t.is_meta:
        return torch.zeros(t.shape, dtype=t.dtype)
    return t


def _to_meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t


def run_whole(name: str, real: nn.Module):
    """The forward the meta module ``name`` runs instead of its own: ``real``'s on CPU zeros shaped like
    its inputs, outside every torch-function mode (the trace's tracker, the meta device), its outputs
    back on meta. A split input is recorded as a violation on the running trace's tracker."""

    def forward(*args, **kwargs):
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for mode in torch.overrides._get_current_function_mode_stack():
            split = [mode.sharded[id(t)] for t in inputs if id(t) in getattr(mode, "sharded", {})]
            if split:
                why = f"{name} ({type(real).__name__}), kept whole (data-dependent), reads split activations"
                mode.violations.append((frozenset().union(*split), why))
        with torch._C.DisableTorchFunction(), torch.no_grad():
            out = real(*tree_map(_to_cpu, args), **tree_map(_to_cpu, kwargs))
        return tree_map(_to_meta, out)

    return forward


class RunWhole:
    """``with RunWhole(meta, probes)``: the modules named in ``probes`` (name -> ``materialize``'s copy)
    run whole on CPU (``run_whole``) while the block runs."""

    def __init__(self, meta: nn.Module, probes: dict[str, nn.Module] | None):
        self.targets = [(meta.get_submodule(n), run_whole(n, real)) for n, real in (probes or {}).items()]

    def __enter__(self):
        for module, forward in self.targets:
            module.forward = forward

    def __exit__(self, *exc):
        for module, _ in self.targets:
            del module.forward
