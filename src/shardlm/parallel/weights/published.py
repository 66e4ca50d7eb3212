"""Published checkpoint layouts: the names (and merges, concatenations, chunks) that checkpoints
store on disk, converted to the names the model holds in memory by transformers' own rules.

transformers 5 keeps, per model type or class, a list of weight transforms
(``transformers.conversion_mapping.get_model_conversion_mapping``): ``WeightRenaming`` /
``PrefixChange`` rename keys, ``WeightConverter`` runs operations (``MergeModulelist`` stacks
per-expert tensors, ``Concatenate``, ``Chunk``, ``Split``, ...). ``from_pretrained`` applies them
while loading and ``save_pretrained`` applies their reverse. Nothing here re-types a rule: the
rules, their key matching (``rename_source_key``, in transformers' key order) and the reverse
conversion (``revert_weight_conversion``) are transformers' own.

Loading (``load``): every rank still reads only its own rows, through DCP's HF storage reader.

* a renamed key (rename, prefix change, a key kept as is): the parameter is read under the
  checkpoint's name, shard by shard as before;
* ``MergeModulelist`` (+ ``Concatenate``), ``Concatenate``, ``Chunk``, ``Split``: each source
  tensor is one box of the target tensor (``_pieces``); a rank reads from every source only the
  part that overlaps its own piece of the target, straight into views of its local tensor;
* any other operation (``Interleave``, ``PermuteForRope``, the model-specific ones): each rank
  reads that converter's source tensors whole, once, runs transformers' converter on them and
  keeps its piece.

Before spawning (``check``): the checkpoint's names after conversion must cover the model, with
the model's shapes; otherwise one line naming the first missing (or misshapen) weight.

Consolidation writes the layout back (``published_write.py``).
"""

from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from dataclasses import dataclass, field
from itertools import product

import torch
import torch.nn as nn

from shardlm.distributed.shards import LoadPlanner, PackedShards, fill_from_full, index_runs, local_index, packed_view
from shardlm.errors import ConfigError
from shardlm.parallel.model.hf import tied_keys


@dataclass
class Piece:
    """One box of a source tensor placed in a target tensor: ``target[target_offset : +size] =
    source[source_offset : +size]``; ``stacked``: the target has one more leading dim (a stacked
    expert list) and the box sits at ``target_offset[0]`` of it."""

    source: str
    source_offset: tuple[int, ...]
    target_offset: tuple[int, ...]
    size: tuple[int, ...]
    stacked: bool = False


@dataclass
class Unit:
    """One entry of transformers' load loop: the in-memory tensors one transform produces and the
    checkpoint tensors it reads, in the order transformers collects them."""

    key: str  # the first target key (transformers' ``param_name_to_load`` key)
    converter: object | None  # a ``WeightConverter``; None: a renamed (or unchanged) key
    sources: dict[str, list[str]]  # source pattern -> checkpoint keys
    outputs: dict[str, tuple[int, ...] | None] = field(default_factory=dict)  # in-memory key -> shape
    pieces: dict[str, list[Piece]] | None = None  # None: read whole (or a rename)
    kind: str = "rename"
    error: str | None = None  # transformers' converter failed on the checkpoint's shapes


@dataclass
class Layout:
    """A checkpoint's keys mapped onto a model by transformers' rules."""

    units: list[Unit]
    by_key: dict[str, Unit]  # in-memory key -> its unit
    unexpected: list[str]
    used: list[int]  # indices into ``rules(model)`` of the transforms that matched
    rule_names: list[str]
    keys: frozenset[str] = frozenset()  # the checkpoint's keys


def rules(model: nn.Module) -> list:
    """The transforms ``from_pretrained`` applies to ``model`` (no user key mapping, no quantizer)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model)


def meta_tensor(shape, dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def map_checkpoint(model: nn.Module, available: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Layout:
    """Map checkpoint keys (``{key: (shape, dtype)}``) onto ``model`` (on meta) as
    ``convert_and_load_state_dict_in_model`` does: keys in its order, all renamings then at most
    one converter, the base-model prefix added or stripped; the converters run on meta tensors to
    learn the names and shapes they give."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = rules(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_sd = model.state_dict()
    prefix = model.base_model_prefix
    units: dict[str, Unit] = {}
    unexpected: list[str] = []
    for key in sorted(available, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
        if renamed not in meta_sd and key in meta_sd:
            renamed, pattern = rename_source_key(key, [], [], prefix, meta_sd)
        if renamed in meta_sd:
            if pattern is not None:
                unit = units.setdefault(renamed, Unit(renamed, deepcopy(by_pattern[pattern]), {}, kind="convert"))
                unit.sources.setdefault(pattern, []).append(key)
            else:
                units.setdefault(renamed, Unit(renamed, None, {"": [key]}, {renamed: tuple(available[key][0])}))
        elif pattern is not None:
            targets = by_pattern[pattern].target_patterns
            unexpected += [renamed.replace(targets[0], t) for t in targets]
        else:
            unexpected.append(renamed)
    for unit in units.values():
        if unit.converter is not None:
            _plan_converter(unit, model, available)
    by_key = {out: unit for unit in units.values() for out in unit.outputs}
    used = [i for i, t in enumerate(transforms) if t.was_used()]
    return Layout(list(units.values()), by_key, unexpected, used, [repr(t) for t in transforms], frozenset(available))


def _run_converter(unit: Unit, model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' converter of ``unit`` on ``tensors`` (checkpoint key -> tensor): its outputs."""
    conv = deepcopy(unit.converter)
    for pattern, keys in unit.sources.items():
        for key in keys:
            conv.add_tensor(unit.key, key, pattern, tensors[key])
    out = conv.convert(unit.key, model=model, config=model.config)
    return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


def _plan_converter(unit: Unit, model: nn.Module, available: dict) -> None:
    try:
        meta = {k: meta_tensor(*available[k]) for keys in unit.sources.values() for k in keys}
        unit.outputs = {k: tuple(v.shape) for k, v in _run_converter(unit, model, meta).items()}
    except Exception as exc:  # noqa: BLE001 - the checkpoint's tensors do not fit the rule (or an op needs values)
        targets = unit.converter.target_patterns
        unit.outputs = {unit.key.replace(targets[0], t): None for t in targets}
        unit.kind = "whole"
        ops = "+".join(type(op).__name__ for op in unit.converter.operations)
        unit.error = f"transformers' {ops} fails on the checkpoint's shapes: {' '.join(str(exc).split())[:160]}"
        return
    unit.pieces = _pieces(unit, available)
    unit.kind = "boxes" if unit.pieces is not None else "whole"


def _pieces(unit: Unit, available: dict) -> dict[str, list[Piece]] | None:
    """Each source as a box of its target, for the operation chains whose geometry is a tiling:
    ``MergeModulelist(0)`` [+ ``Concatenate(d)``], ``Concatenate(d)``, ``Chunk(d)``, ``Split(d)``.
    None for anything else (read whole). The tiling is checked against the shapes transformers'
    own converter gave on meta tensors."""
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, Split

    ops = unit.converter.operations
    kinds = [type(op) for op in ops]
    order = [p for p in unit.converter.source_patterns if p in unit.sources]
    shape = {k: tuple(available[k][0]) for keys in unit.sources.values() for k in keys}
    outs = list(unit.outputs)
    pieces: dict[str, list[Piece]] = {k: [] for k in outs}
    if kinds and kinds[0] is MergeModulelist and ops[0].dim == 0 and kinds[1:] in ([], [Concatenate]):
        if len(outs) != 1 or (len(kinds) == 1 and len(order) != 1):
            return None
        cat = ops[1].dim if len(kinds) == 2 else None
        if cat is not None and cat < 1:
            return None
        offset = 0
        for pattern in order:
            keys = unit.sources[pattern]
            for e, key in enumerate(keys):
                target = [e] + [0] * len(shape[key])
                if cat is not None:
                    target[cat] = offset
                pieces[outs[0]].append(Piece(key, (0,) * len(shape[key]), tuple(target), shape[key], stacked=True))
            if cat is not None:
                offset += shape[keys[0]][cat - 1]
    elif kinds == [Concatenate]:
        if len(outs) != 1:
            return None
        dim, offset = ops[0].dim, 0
        for pattern in order:
            for key in unit.sources[pattern]:
                target = [0] * len(shape[key])
                target[dim] = offset
                pieces[outs[0]].append(Piece(key, (0,) * len(shape[key]), tuple(target), shape[key]))
                offset += shape[key][dim]
    elif kinds in ([Chunk], [Split]) and len(order) == 1 and len(unit.sources[order[0]]) == 1:
        key, dim, offset = unit.sources[order[0]][0], ops[0].dim, 0
        for out in outs:
            source = [0] * len(shape[key])
            source[dim] = offset
            pieces[out].append(Piece(key, tuple(source), (0,) * len(shape[key]), unit.outputs[out]))
            offset += unit.outputs[out][dim]
    else:
        return None
    return pieces if all(_tiles(unit.outputs[k], pieces[k]) for k in outs) else None


def _tiles(target: tuple[int, ...] | None, pieces: list[Piece]) -> bool:
    """The pieces lie inside ``target`` and their volumes add up to it (they never overlap: each
    is placed at a distinct offset along the dim that was stacked or concatenated)."""
    if target is None:
        return False
    total = 0
    for p in pieces:
        size = ((1,) if p.stacked else ()) + tuple(p.size)
        if len(size) != len(target) or any(o + s > t for o, s, t in zip(p.target_offset, size, target)):
            return False
        total += torch.Size(size).numel()
    return total == torch.Size(target).numel()


def header(model_path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (shape, dtype)}`` of the safetensors files in ``model_path`` (headers only)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    metadata = HuggingFaceStorageReader(model_path).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) for k, v in metadata.state_dict_metadata.items()}


def untied_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """In-memory keys a checkpoint must hold (tied duplicates left out), with their shapes."""
    tied = tied_keys(model)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in tied}


def stored_as(model: nn.Module, layout: Layout, key: str, shape: tuple[int, ...]) -> list[str]:
    """The checkpoint keys in-memory ``key`` has in ``layout``'s layout: what ``save_pretrained``
    writes for it (``revert_weight_conversion``) with the rules the checkpoint matched (a prefix
    change among them) and those it applies to a new model (Pythia's ``embed_out``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, revert_weight_conversion

    new = {repr(t) for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)}
    chosen = [t for i, t in enumerate(rules(model)) if i in layout.used or repr(t) in new]
    saved = model.__dict__.get("_weight_conversions")
    model._weight_conversions = chosen
    try:
        return list(revert_weight_conversion(model, {key: meta_tensor(shape, torch.float32)}))
    except Exception:  # noqa: BLE001 - a reverse that needs values: name the in-memory key alone
        return [key]
    finally:
        if saved is None:
            del model._weight_conversions
        else:
            model._weight_conversions = saved


def _gap(model: nn.Module | None, layout: Layout, key: str, shape, detail: str | None) -> str:
    """``key`` as the refusal names it: with its checkpoint names where they differ, the absent ones first."""
    names = stored_as(model, layout, key, shape) if model is not None and shape is not None else [key]
    absent = [n for n in names if n not in layout.keys]
    if names == [key]:
        where = None
    elif len(names) == 1:
        where = f"stored as {names[0]} in this layout"
    elif absent:
        more = f" and {len(absent) - 1} more of them" if len(absent) > 1 else ""
        where = f"stored as {len(names)} tensors in this layout; {absent[0]}{more} absent"
    else:
        where = f"stored as {len(names)} tensors in this layout, such as {names[0]}"
    parts = [p for p in (where, detail) if p]
    return f"{key} ({'; '.join(parts)})" if parts else key


def missing(layout: Layout, needed: dict[str, tuple[int, ...] | None], model: nn.Module | None = None) -> list[str]:
    """Needed keys the layout does not produce, or produces with another shape, in model order;
    with ``model`` (its meta model), each named with its checkpoint names in this layout too."""
    out = []
    for key, shape in needed.items():
        unit = layout.by_key.get(key)
        got = unit.outputs.get(key) if unit else None
        if unit is None:
            out.append(_gap(model, layout, key, shape, None))
        elif unit.error is not None:
            out.append(_gap(model, layout, key, shape, unit.error))
        elif shape is not None and got is not None and tuple(got) != tuple(shape):
            out.append(_gap(model, layout, key, shape, f"converted: {list(got)}, the model needs {list(shape)}"))
    return out


def refuse_missing(model_path: str, gaps: list[str]) -> None:
    if gaps:
        raise ConfigError(f"model: '{model_path}' lacks weights for {gaps[0]} (and {len(gaps) - 1} more)")


def check(model_path: str, model: nn.Module) -> Layout:
    """Before spawning: the checkpoint at ``model_path``, converted by transformers' rules, covers
    ``model`` (its meta model) with the model's shapes; else one ``ConfigError`` naming the first gap."""
    layout = map_checkpoint(model, header(model_path))
    refuse_missing(model_path, missing(layout, untied_shapes(model), model))
    return layout


# --- loading, on every rank -------------------------------------------------------------------


def _local_boxes(param: torch.Tensor, piece: Piece):
    """(source offsets, view of ``param``'s local tensor) for every box of ``piece`` this rank holds."""
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    lead = 1 if piece.stacked else 0
    per_dim = []
    for d in range(param.ndim):
        if lead and d == 0:
            start, length, source = piece.target_offset[0], 1, None
        else:
            start, length, source = piece.target_offset[d], piece.size[d - lead], piece.source_offset[d - lead]
        cut = []
        for local_start, global_start, run in index_runs(local_index(param, d)):
            a, b = max(global_start, start), min(global_start + run, start + length)
            if a < b:
                cut.append((local_start + a - global_start, None if source is None else source + a - start, b - a))
        per_dim.append(cut)
    for combo in product(*per_dim):
        view = local
        for d, (local_start, _, length) in enumerate(combo):
            view = view.narrow(d, local_start, length)
        if lead:
            view = view.select(0, 0)
        yield torch.Size(c[1] for c in combo[lead:]), view


def _source_boxes(size: tuple[int, ...], boxes: list, placeholder: torch.Tensor):
    """A checkpoint tensor as DCP sees it when it lands in boxes of other tensors (``shards.PackedShards``'
    protocol, with the boxes given)."""
    obj = PackedShards.__new__(PackedShards)
    obj.local, obj.global_size, obj.boxes = placeholder, torch.Size(size), boxes
    return obj


def load(state: dict[str, torch.Tensor], model_path: str, meta: nn.Module) -> None:
    """Fill ``state`` (``{in-memory HF key: (D)Tensor}``, this rank's pieces) from the checkpoint
    at ``model_path`` through transformers' conversion rules; see the module docstring. ``meta``:
    a fresh meta model of ``model_path`` (the trained one's class is FSDP's subclass, and
    transformers looks rules up by class name; its keys may be peft's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    available = header(model_path)
    layout = map_checkpoint(meta, available)
    refuse_missing(model_path, missing(layout, {k: tuple(v.shape) for k, v in state.items()}, meta))
    direct: dict[str, torch.Tensor] = {}
    boxes: dict[str, list] = defaultdict(list)
    whole: dict[int, Unit] = {}
    for key, tensor in state.items():
        unit = layout.by_key[key]
        if unit.converter is None:
            direct[unit.sources[""][0]] = tensor.detach()
        elif unit.pieces is not None:
            for piece in unit.pieces[key]:
                boxes[piece.source].extend(_local_boxes(tensor.detach(), piece))
        else:
            whole[id(unit)] = unit
    dcp_state = packed_view(direct)
    for source, found in boxes.items():
        placeholder = found[0][1] if found else torch.empty(0)
        dcp_state[source] = _source_boxes(available[source][0], found, placeholder)
    with torch.no_grad():
        dcp.load(dcp_state, storage_reader=HuggingFaceStorageReader(model_path), planner=LoadPlanner())
        for unit in whole.values():  # transformers' converter on whole source tensors, one unit at a time
            keys = [k for ks in unit.sources.values() for k in ks]
            full = {k: torch.empty(available[k][0], dtype=available[k][1]) for k in keys}
            dcp.load(full, storage_reader=HuggingFaceStorageReader(model_path), no_dist=True)
            for out, tensor in _run_converter(unit, meta, full).items():
                if out in state:
                    fill_from_full(state[out], tensor)
            del full


def describe(layout: Layout) -> dict[str, int]:
    """How many in-memory tensors each way of reading gives (rename, boxes, whole)."""
    counts: dict[str, int] = defaultdict(int)
    for unit in layout.units:
        counts[unit.kind] += len(unit.outputs)
    return dict(counts)
