"""Random initialization that no rank ever holds whole: the model's own init, one block at a time.

Why: a model directory with only ``config.json`` starts from a seeded random init. Building the
whole model on one rank and broadcasting it (what shardlm did first) takes hours and hundreds of
GB of host memory at 70B. Here every rank walks the meta model in transformers' init order
(children before their parent, as ``PreTrainedModel.initialize_weights`` does) one *unit* at a
time: a decoder block with everything inside it, or any subtree that holds no decoder block (the
embeddings, the final norm, the LM head), since a module's init may reach into its children
(GPT-2's attention rescales its ``c_proj``). A unit is materialized on the CPU, seeded from
``seed`` and its name, initialized by the model's own ``_init_weights``, handed over tensor by
tensor, and dropped. Memory: one unit. Communication: none. ``reference_model`` runs the same
walk in one process: that is what "the same values as one process" means for a seeded init.

Every parameter starts as NaN: one that its unit's init leaves unwritten (an init reaching across
units, one that scales construction-time values) is caught and ``seeded_state`` raises
``UnwrittenInit``; the callers then build the model whole from ``torch.manual_seed(seed)`` instead
(every rank reaches the same unit, so all of them switch together).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
import torch.nn as nn

_SEED_BITS = 63


def unit_seed(seed: int, name: str) -> int:
    """A seed for unit ``name`` that depends on nothing but ``seed`` and the name."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << _SEED_BITS) - 1)


def _units(model: nn.Module, blocks: list[nn.Module]) -> list[tuple[str, list[nn.Module], nn.Module]]:
    """``(name, modules in init order, owner of their _init_weights)`` for each unit, in init order."""
    from transformers import PreTrainedModel

    block_ids = {id(b) for b in blocks}
    holds_block = set()
    for module in model.modules():
        if any(id(m) in block_ids for m in module.modules()):
            holds_block.add(id(module))
    units = []

    def post_order(module: nn.Module) -> list[nn.Module]:
        return [m for child in module.children() for m in post_order(child)] + [module]

    def walk(module: nn.Module, name: str, owner: nn.Module) -> None:
        if id(module) in block_ids or id(module) not in holds_block:
            units.append((name, post_order(module), owner))
            return
        for child_name, child in module.named_children():
            child_owner = child if isinstance(child, PreTrainedModel) else owner
            walk(child, f"{name}.{child_name}" if name else child_name, child_owner)
        units.append((name, [module], owner))  # an ancestor of blocks: its own parameters only

    walk(model, "", model)
    return units


@torch.no_grad()
def _init_unit(modules: list[nn.Module], owner: nn.Module, seed: int, done: set[int]) -> list | None:
    """Materialize and initialize ``modules``; their ``(module, name)`` parameters, or None when
    the init left some element unwritten. Parameters in ``done`` (ids: the second name of a tied
    weight) stay on meta, where the init does nothing."""
    from transformers.initialization import guard_torch_init_functions

    params = []
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta and id(param) not in done:
                done.add(id(param))
                full = torch.full(param.shape, float("nan"), dtype=param.dtype)
                module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
                params.append((module, name))
    with torch.random.fork_rng(devices=[]), guard_torch_init_functions():
        torch.manual_seed(seed)
        for module in modules:
            owner._init_weights(module)
    if any(torch.isnan(module._parameters[name]).any() for module, name in params):
        return None
    return params


class UnwrittenInit(Exception):
    """A unit's init left some of its parameters unwritten (see the module docstring)."""


def seeded_state(meta_model: nn.Module, blocks: list[nn.Module], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(fqn, full tensor)`` for every parameter of ``meta_model`` (a fresh meta-device build, whose
    parameters this consumes; a tied weight once, under its first name), one unit at a time; a
    tensor is valid until the next unit is drawn.
    Raises ``UnwrittenInit`` at the first unit whose init does not write all of its parameters."""
    names = {id(m): n for n, m in meta_model.named_modules()}
    done: set[int] = set()
    for unit_name, modules, owner in _units(meta_model, blocks):
        params = _init_unit(modules, owner, unit_seed(seed, unit_name), done)
        if params is None:
            raise UnwrittenInit(f"the init of '{unit_name or type(meta_model).__name__}' leaves parameters unwritten")
        for module, name in params:
            yield ".".join(x for x in (names[id(module)], name) if x), module._parameters[name].detach()
        for module, name in params:  # drop the unit
            module._parameters[name] = nn.Parameter(module._parameters[name].to("meta"), requires_grad=False)
