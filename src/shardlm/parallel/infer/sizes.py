"""Which int attributes of a mixer its forward uses as the size of a split dim, and which as a whole one.

A mixer's sizes are made local by value (``channels.local_sizes``: an int attribute the forward
reads that equals a split width is divided by tp). Values collide: Mamba-2's ``ssm_state_size``
equals its ``num_heads`` in published configs (Nemotron-H: 128 and 128), but it sizes the state
dim of ``B.view(batch, seq, n_groups, ssm_state_size)``, which the split never touches. During the
trace the int attributes a module's forward reads come back as ``NamedInt`` (an int that carries
its owner and name); a view, reshape or cut of a split tensor then tells, per position, whether
the attribute sized its split dim (``split``) or another one (``whole``). An attribute only ever
used whole stays as it is; one only ever used split is made local even where its value equals a
head width (Falcon-H1's mamba ``num_heads``, 16, its attention's ``head_dim``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlm.parallel.infer.layouts import Layout
from shardlm.parallel.model.hf import is_linear

_RESHAPES = {"view", "reshape"}
_CUTS = {"split", "split_with_sizes"}


class NamedInt(int):
    """An int attribute ``owner.name`` as the trace hands it to the forward (an int in every use)."""

    owner: str
    name: str

    def __new__(cls, value: int, owner: str, name: str) -> NamedInt:
        obj = super().__new__(cls, value)
        obj.owner, obj.name = owner, name
        return obj


def record_uses(
    op: str, args: tuple, kwargs: dict, out, layouts: dict[int, Layout], uses: dict[str, dict[str, set[str]]]
) -> None:
    """Add to ``uses`` (owner -> attribute -> {"split", "whole"}) what op ``op`` of a split tensor, or
    of one held whole on every rank (``args[0]``, its output ``out``) used each ``NamedInt`` among its
    sizes for."""
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is None:
        return
    if op in _RESHAPES and isinstance(out, torch.Tensor):
        sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        sizes = kwargs.get("shape", kwargs.get("size", sizes))
        if len(sizes) != out.dim():
            return
        split = out.dim() + layouts[id(out)][0] if id(out) in layouts else None  # a tensor held whole: none
        found = [(v, "split" if i == split else "whole") for i, v in enumerate(sizes)]
    elif op in _CUTS:
        sizes = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_sizes", ()))
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        along = id(first) in layouts and isinstance(dim, int)
        along = along and (dim - first.dim() if dim >= 0 else dim) == layouts[id(first)][0]
        found = [(v, "split" if along else "whole") for v in (sizes if isinstance(sizes, (tuple, list)) else [sizes])]
    else:
        return
    for value, use in found:
        if isinstance(value, NamedInt):
            uses.setdefault(value.owner, {}).setdefault(value.name, set()).add(use)


_FACTORIES = {"zeros", "ones", "empty", "full", "new_zeros", "new_ones", "new_empty", "new_full"}


def record_made(op: str, args: tuple, kwargs: dict, out, made: dict[int, tuple]) -> bool:
    """A new tensor sized by ``NamedInt`` attributes (Zaya's ``new_zeros(batch, 1, self.hidden_size)``):
    ``made`` keeps its sizes, so that a column-parallel linear reading it (``record_linear_input``)
    tells its last size is the whole hidden width, not a head-concatenation width to make local."""
    if op not in _FACTORIES or not isinstance(out, torch.Tensor) or not out.dim():
        return False
    sizes = args[1:] if op.startswith("new_") else args
    sizes = sizes[0] if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else sizes
    sizes = kwargs.get("size", sizes)
    if op.endswith("full") and len(sizes) == out.dim() + 1:
        sizes = sizes[:-1]  # ``full(size..., fill_value)`` spelt positionally
    if any(isinstance(v, NamedInt) for v in sizes):
        made[id(out)] = tuple(sizes)
        return True
    return False


def record_linear_input(x, made: dict[int, tuple], uses: dict[str, dict[str, set[str]]]) -> None:
    """A column-parallel linear reads ``x``: an attribute that sized ``x``'s last dim sized a whole one."""
    value = made.get(id(x), (None,))[-1] if isinstance(x, torch.Tensor) else None
    if isinstance(value, NamedInt):
        uses.setdefault(value.owner, {}).setdefault(value.name, set()).add("whole")


def split_attributes(uses: dict[str, dict[str, set[str]]], values) -> list[int | None]:
    """Per value of ``values``, its value where it is an int attribute the running forward used as the size of
    a split dim (``uses``: ``record_uses``), else None: what a tensor sized by it is made at on each rank, once
    that attribute is made local (MiniMax's ``zeros(batch, self.num_attention_heads, ...)``)."""
    return [
        int(v) if isinstance(v, NamedInt) and "split" in uses.get(v.owner, {}).get(v.name, ()) else None for v in values
    ]


def used_only(uses: dict[str, dict[str, set[str]]], use: str) -> dict[str, set[str]]:
    """Owner -> the attributes it used only as ``use`` ("whole": the size of a dim the split never
    touches; "split": the size of a split dim, a head count even where it equals a head width)."""
    return {owner: {a for a, u in attrs.items() if u == {use}} for owner, attrs in uses.items()}


def holds_linear(module: nn.Module) -> bool:
    """Whether ``module`` holds a linear among its children: the modules whose reads the trace watches."""
    return any(is_linear(child) for child in module.children())


def watch_reads(module: nn.Module, names: set[str], fqn: str) -> type:
    """Record in ``names`` every attribute read on ``module`` (until its class is restored: the
    returned original). The trace learns which sizes a mixer's forward reads (``self.key_dim``),
    so that only those are made local (``Plan.local_sizes``), not a size it keeps for its cache;
    an int attribute is read as a ``NamedInt`` (what it sizes)."""
    cls = type(module)

    def __getattribute__(self, attr):  # noqa: N807 - the hook is this dunder
        names.add(attr)
        value = cls.__getattribute__(self, attr)
        return NamedInt(value, fqn, attr) if type(value) is int else value

    module.__class__ = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__})
    return cls


def declare_sizes_records(tracker) -> None:
    """The records this concept keeps on the ``ShardTracker`` (its ``__init__`` calls each concept's)."""
    # module -> sizes of the split dims of the tensors its own code made (a mixer's key_dim, num_k_heads)
    tracker.split_sizes: dict[str, set[int]] = {}
    tracker.int_uses: dict[str, dict[str, set[str]]] = {}  # ``sizes.record_uses``
    tracker.made: dict[int, tuple] = {}  # id(new tensor) -> the sizes it was made with (``sizes.record_made``)
