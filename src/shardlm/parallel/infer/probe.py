"""Modules whose forward depends on tensor values, kept whole and run on real CPU tensors during the trace.

The trace runs on meta tensors, which hold no data. Most questions a modeling file asks of values have an
answer without data (``meta_answers.py``), but some ops have no shape without data: a boolean mask's rows
(``x[mask]``, whose meta kernel calls ``nonzero``), BLT's patch lengths from entropies, XMOD's per-language
adapters. Such a module is *kept whole*: its linears stay replicated on every rank (``Plan.replicated``,
with this reason) and, in every later trace and in the dry run, its forward runs on a real CPU copy of it
(``materialize``: small random parameters, the model's own buffers) with its inputs made real (zeros) and
its outputs moved back to meta (``run_whole``). What it reads split is a violation like any other (the
sub-block feeding it stays replicated): it computes on whole tensors only.

Most such modules are split all the same, all but their *tail* (``run_tail``): a module whose value-dependent
op comes in its own code after every one of its parameters was used (BLT's patcher: a small decoder whose
logits' entropies, past a threshold, set the patch lengths) is traced like any other, its decoder split, and
only what follows the failing op (parameter-free: entropies -> patch lengths) runs whole on CPU. Everything
that tail can read, the module's inputs and its children's outputs, must be whole (a split one is a violation
naming its linears), so every rank computes the tail on the same whole tensors: each rank decides the same
patches. A module whose value-dependent op comes before a parameter is used (XMOD's adapters run on the rows
a mask picks) raises ``NotTail`` and is kept whole as above.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

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
        _violate_split_reads((args, kwargs), f"{name} ({type(real).__name__}), kept whole (data-dependent)")
        return _run_real(real, args, kwargs)

    return forward


class Probe(NamedTuple):
    """A module whose forward depends on tensor values: ``real``, its CPU copy (``materialize``); ``whole``:
    its whole forward runs on it (``run_whole``), else only its tail (``run_tail``)."""

    real: nn.Module
    whole: bool


class NotTail(RuntimeError):
    """A module tried as a tail (``run_tail``) whose value-dependent op is not after all its parameters."""

    def __init__(self, name: str):
        super().__init__(f"{name}: its value-dependent op is not after all its parameters")
        self.name = name


def run_tail(name: str, meta: nn.Module, real: nn.Module):
    """The forward the meta module ``name`` runs instead of its own: its own, traced like any module's, until
    an op whose output shape depends on the data; if every submodule holding parameters has run by then (in
    the order ``real`` runs them), and the module holds none itself, the rest (its tail) is ``real``'s
    outputs on CPU zeros, back on meta; else ``NotTail``. What the tail may read, the inputs and every
    submodule's output, is a violation where split."""
    own, holds = meta.forward, any(True for _ in meta.parameters(recurse=False))

    def forward(*args, **kwargs):
        open_, done, outputs = [], [], [args, kwargs]
        handles = _watch(meta, done, open_, outputs)
        try:
            return own(*args, **kwargs)
        except Exception as exc:
            if not depends_on_values(exc):
                raise
        finally:
            for h in handles:
                h.remove()
        really_done: list[str] = []
        handles = _watch(real, really_done, [], [])
        try:
            out = _run_real(real, args, kwargs)
        finally:
            for h in handles:
                h.remove()
        if holds or open_ or really_done != done:
            raise NotTail(name)
        _violate_split_reads(outputs, f"{name} ({type(real).__name__}), its value-dependent tail run whole")
        return out

    return forward


def _watch(module: nn.Module, done: list[str], open_: list[str], outputs: list) -> list:
    """Hooks on ``module``'s submodules: those running now in ``open_``, those holding parameters that
    finished in ``done`` (in order), its children's outputs in ``outputs``."""
    handles, children = [], {id(c) for c in module.children()}
    for sub_name, sub in module.named_modules():
        if sub is module:
            continue
        owns, child = any(True for _ in sub.parameters(recurse=False)), id(sub) in children
        handles.append(sub.register_forward_pre_hook(lambda m, a, n=sub_name: open_.append(n)))

        def post(m, a, o, n=sub_name, owns=owns, child=child):
            open_.remove(n)
            if child:
                outputs.append(o)
            if owns:
                done.append(n)

        handles.append(sub.register_forward_hook(post))
    return handles


def _violate_split_reads(tensors, why: str) -> None:
    """A violation on the running trace's tracker for every split tensor in ``tensors`` (a pytree)."""
    inputs = [t for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor)]
    for mode in torch.overrides._get_current_function_mode_stack():
        split = [mode.sharded[id(t)] for t in inputs if id(t) in getattr(mode, "sharded", {})]
        if split:
            mode.violations.append((frozenset().union(*split), f"{why}, reads split activations"))


def _run_real(real: nn.Module, args, kwargs):
    """``real``'s forward on CPU zeros shaped like ``args``/``kwargs``, outside every torch-function mode,
    its outputs back on meta."""
    with torch._C.DisableTorchFunction(), torch.no_grad():
        out = real(*tree_map(_to_cpu, args), **tree_map(_to_cpu, kwargs))
    return tree_map(_to_meta, out)


class RunWhole:
    """``with RunWhole(meta, probes)``: the modules named in ``probes`` (name -> ``Probe``) run whole on CPU
    (``run_whole``), or only their tails (``run_tail``), while the block runs."""

    def __init__(self, meta: nn.Module, probes: dict[str, Probe] | None):
        self.targets = [
            (meta.get_submodule(n), run_whole(n, p.real) if p.whole else run_tail(n, meta.get_submodule(n), p.real))
            for n, p in (probes or {}).items()
        ]

    def __enter__(self):
        for module, forward in self.targets:
            module.forward = forward

    def __exit__(self, *exc):
        for module, _ in self.targets:
            del module.forward
