"""Head counts and widths set to their local values after TP (``localize_geometry``): attention
modules reading ``self.num_heads``, ``self.split_size``, ``self.config.num_attention_heads`` get the
per-rank numbers, mixers their ``Plan.local_sizes``. Used by the builder and by the dry run at one
rank's shapes, so it belongs to the plan, not to the runtime styles.
"""

from __future__ import annotations

import copy
import weakref

import torch.nn as nn

from shardlm.errors import ConfigError
from shardlm.parallel.model.hf import (
    MODULE_HEAD_ATTRS,
    MODULE_KV_ATTRS,
    out_features,
)
from shardlm.parallel.plan.plan import Plan

# head-concatenation widths an attention module may read (divided by tp unless ``Plan.local_sizes`` sets them)
WIDTH_ATTRS = ("split_size", "hidden_size", "embed_dim", "all_head_size", "head_size_total")


def localize_geometry(model: nn.Module, plan: Plan, tp: int) -> None:
    """Set head counts and head-concatenation widths of attention modules to their local values.

    Only modules that own a head-count attribute and hold column-parallel children are touched;
    a module reading ``self.config`` for head counts gets its own localized copy of the config.
    """
    for name, sizes in plan.local_sizes.items():  # a mixer's widths (``channels.local_sizes``)
        module = model.get_submodule(name)
        for attr, value in sizes.items():
            if attr.startswith("config."):  # a count the module reads off its config: a copy of its own
                if not getattr(module, "_local_config", False):
                    module.config, module._local_config = copy.copy(module.config), True
                setattr(module.config, attr[len("config.") :], value)
            else:
                setattr(module, attr, value)
    config = model.config
    if not plan.attention:
        return  # attention-free, or every attention block kept replicated
    kv = plan.geometry.kv or 0
    local_kv = plan.kv_heads[1] or kv // tp  # 1 when kv heads are replicated (fewer than tp)
    for name in plan.attention:
        module = model.get_submodule(name)
        if not localize_geometry_of(module, name, plan, tp):
            continue
        localize_rebuilt(model, name, plan, tp)
        if getattr(module, "config", None) is config:
            local = copy.copy(config)
            for attr in ("num_attention_heads", "n_head", "num_key_value_heads", "num_kv_heads"):
                if isinstance(getattr(config, attr, None), int):
                    value = getattr(config, attr)
                    setattr(local, attr, local_kv if attr in MODULE_KV_ATTRS and value == kv else value // tp)
            module.config = local


def localize_geometry_of(module: nn.Module, name: str, plan: Plan, tp: int) -> bool:
    """Set the head counts and widths of attention module ``name`` (``module``) to their local values;
    False where it owns no head-count attribute (its config, if it reads one, is left to the caller)."""
    heads, kv, head_dim = own_geometry(module, name, plan)
    if (heads, kv, head_dim) == (plan.geometry.heads or 0, plan.geometry.kv or 0, plan.geometry.head_dim or 0):
        local_kv = plan.kv_heads[1] or kv // tp  # 1 when kv heads are replicated (fewer than tp)
    else:
        local_kv = kv // tp  # its own kv heads (BLT's sub-configs): split; fewer than tp fail the dry run
    groups = getattr(module, "num_key_value_groups", None)
    own_sizes = plan.local_sizes.get(name, {})  # set already (``localize_geometry``): one shared kv head's groups
    if isinstance(groups, int) and not isinstance(groups, bool) and "num_key_value_groups" not in own_sizes:
        # query heads per kv head on this rank: 1 where kv heads are replicated (eager attention
        # repeats k/v by it; sdpa packs by it). Read off the module's own groups where they differ
        # from the config's kv heads (MiMo-V2-Flash's sliding layers hold twice the kv heads)
        own_kv = heads // groups if groups and heads % groups == 0 else kv
        own_local_kv = own_kv // tp if own_kv and own_kv % tp == 0 else local_kv
        module.num_key_value_groups = max(1, (heads // tp) // own_local_kv)
    if not any(isinstance(getattr(module, a, None), int) for a in MODULE_HEAD_ATTRS + MODULE_KV_ATTRS):
        return False
    for attr in MODULE_HEAD_ATTRS + MODULE_KV_ATTRS + WIDTH_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, bool) or not isinstance(value, int) or attr in own_sizes:
            continue  # a mixer's head count (Mamba-2's num_heads) is set by its local sizes, as are kept widths
        if (attr in MODULE_HEAD_ATTRS and value == heads) or (attr in WIDTH_ATTRS and value == heads * head_dim):
            setattr(module, attr, value // tp)
        elif attr in MODULE_KV_ATTRS and value == kv:
            setattr(module, attr, local_kv)
    return True


def localize_rebuilt(model: nn.Module, name: str, plan: Plan, tp: int) -> None:
    """Localize attention ``name`` again whenever its parent, holding the model's config, has built a new one
    from that whole config before it runs: BigBird's forward, below its block-sparse length ((5 + 2 *
    num_random_blocks) * block_size tokens), calls ``set_attention_type("original_full")``, which builds a
    ``BigBirdSelfAttention(config)`` of the config's head count around the same (split) query, key and value.
    A forward pre-hook on the parent localizes the new module (``localize_geometry_of``) before it runs.

    Refused there, at run time (the length decides it): an attention that draws random blocks per head
    while training (``num_random_blocks``: BigBird's block-sparse attention, above that length) at tp > 1. It
    seeds NumPy with the layer's index and draws every head's blocks from that one stream, block row by block
    row, heads interleaved: a rank holding heads [a, b) would draw the first heads' blocks, not its own."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if getattr(parent, "config", None) is not model.config:
        return  # builds nothing from the model's config
    localized = weakref.WeakSet([getattr(parent, leaf)])

    def before_parent(module: nn.Module, args) -> None:
        child = getattr(module, leaf)
        if tp > 1 and child.training and random_blocks_length(child) is not None:
            raise ConfigError(random_blocks_refusal(name, child))
        if child not in localized:
            localize_geometry_of(child, name, plan, tp)
            localized.add(child)

    parent.register_forward_pre_hook(before_parent)


def random_blocks_length(attention: nn.Module) -> int | None:
    """The sequence length above which ``attention`` is a block-sparse one that draws random key blocks per head
    in training (BigBird's: (5 + 2 * num_random_blocks) * block_size tokens; below it the model runs full
    attention), or None."""
    blocks, size = getattr(attention, "num_random_blocks", 0) or 0, getattr(attention, "block_size", None)
    return (5 + 2 * blocks) * size if blocks > 0 and isinstance(size, int) else None


def random_blocks_refusal(name: str, attention: nn.Module) -> str:
    """The one line refusing ``attention`` (``random_blocks_length``) in training at tp > 1, at run time (the
    length decides it) and before spawning (``preflight``: ``data.seq_len`` above that length)."""
    return (
        f"parallel.tp: {name} ({type(attention).__name__}) draws its random key blocks for all heads from one "
        f"stream seeded per layer, heads interleaved, so a rank holding some heads would draw others' blocks; "
        f"train on sequences up to {random_blocks_length(attention)} tokens (data.seq_len: full attention), or "
        f"parallel.tp: 1"
    )


def own_geometry(module: nn.Module, name: str, plan: Plan) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) of attention module ``name`` (``module``): its own where its head count is not
    the model's config's and, times its ``head_dim``, tiles a column-parallel child's width (BLT's local encoder,
    global transformer and decoder each read a sub-config, the top-level config naming no head count; ProphetNet's
    decoder reads ``num_decoder_attention_heads``), else the model's. A head count equal to the config's keeps
    the config's geometry, whatever its ``head_dim`` (a DSA indexer's, a linear attention's: widths as before)."""
    geo = plan.geometry
    heads = next((v for a in MODULE_HEAD_ATTRS if _count(v := getattr(module, a, None))), 0)
    head_dim = getattr(module, "head_dim", None)
    if heads and _count(head_dim) and heads != geo.heads:
        split = {
            out_features(m) for child, m in module.named_children() if plan.styles.get(f"{name}.{child}") == "colwise"
        }
        if heads * head_dim in split:
            kv = next((v for a in MODULE_KV_ATTRS if _count(v := getattr(module, a, None))), heads)
            return heads, kv, head_dim
    return geo.heads or 0, geo.kv or 0, geo.head_dim or 0


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
