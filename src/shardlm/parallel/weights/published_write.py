"""What consolidation writes: the published layout, transformers' reverse of the rules the weights
were read by (``published.py`` reads them).

The rules that matched at load time are recorded in the checkpoint
(``hf/shardlm_weight_layout.json``, ``record_layout``) and reversed by
``revert_weight_conversion``, as ``save_pretrained`` does for a model ``from_pretrained`` loaded
(only the rules that matched: a checkpoint in the in-memory names is written back in them);
without a record (random init) the rules ``save_pretrained`` uses for a new model (no
``PrefixChange``: a random-init Qwen3.5 is written as ``model.*``, one loaded from its published
``model.language_model.*`` checkpoint as that). Consolidation writes one checkpoint tensor at a
time (``PublishedUnpack``); where a reverse joins several in-memory tensors into one (the reverse
of a load-time ``Chunk`` or ``Split``), the group is read and written together. The written names
are then mapped forward again by the same rules and must give exactly the model's keys and shapes
(``check_reload``).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
import torch.nn as nn

from shardlm.errors import ConfigError
from shardlm.parallel.weights.published import header, map_checkpoint, meta_tensor, missing, rules, untied_shapes

LAYOUT_FILE = "shardlm_weight_layout.json"


def record_layout(model_path: str, dest: str, model: nn.Module) -> None:
    """Write which of transformers' rules matched the checkpoint at ``model_path`` (``model``: its
    meta model) into ``dest`` (a checkpoint's ``hf/``), so consolidation writes the same layout back."""
    import transformers

    layout = map_checkpoint(model, header(model_path))
    record = {
        "transformers": transformers.__version__,
        "rules_used": [[i, layout.rule_names[i]] for i in layout.used],
    }
    with open(os.path.join(dest, LAYOUT_FILE), "w") as fh:
        json.dump(record, fh, indent=1)


def saving_model(hf_dir: str, model: nn.Module) -> nn.Module:
    """``model``, the meta model of ``hf_dir``, with ``_weight_conversions`` set as ``save_pretrained`` would
    find it: the recorded rules (a model loaded from a checkpoint), else those transformers uses
    for a new model (``revert_weight_conversion``: no ``PrefixChange``, no legacy renamings)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    path = os.path.join(hf_dir, LAYOUT_FILE)
    if os.path.isfile(path):
        with open(path) as fh:
            record = json.load(fh)
        transforms = rules(model)
        chosen = []
        for index, name in record["rules_used"]:
            if index >= len(transforms) or repr(transforms[index]) != name:
                raise ConfigError(
                    f"checkpoint '{os.path.dirname(hf_dir)}' was loaded with the conversion rule {name} of "
                    f"transformers {record['transformers']}, which this transformers does not have at that place"
                )
            chosen.append(transforms[index])
    else:
        chosen = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    model._weight_conversions = chosen
    return model


def _joined_groups(model: nn.Module, keys: list[str]) -> dict[str, list[str]]:
    """In-memory keys that one reverse converter joins into one tensor (the reverse of a load-time
    ``Chunk``/``Split``), grouped as ``revert_weight_conversion`` groups them: ``{key: group}``."""
    from transformers.core_model_loading import WeightConverter, apply_converters, dot_natural_key

    reverse = [t.reverse_transform() for t in model._weight_conversions[::-1]]
    converters = [t for t in reverse if isinstance(t, WeightConverter)]
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(keys, key=dot_natural_key):
        renamed, pattern = apply_converters(key, converters)
        if pattern is not None:
            groups[renamed].append(key)
    return {k: g for g in groups.values() if len(g) > 1 for k in g}


class PublishedUnpack:
    """``consolidate``'s unpack: one checkpoint tensor -> its tensors in the published layout
    (transformers' ``revert_weight_conversion``), after ``inner``. Where the reverse joins several
    in-memory tensors into one, the group's first tensor gives the joined tensor (the others are
    read for it by ``read``, which fills ``{"model.<name>": tensor}`` from the checkpoint) and the
    others give nothing."""

    def __init__(self, hf_dir: str, model: nn.Module, inner, read=None):
        self.model = saving_model(hf_dir, model)
        self.inner = inner
        self.read = read
        self.shapes = untied_shapes(self.model)
        self.groups = _joined_groups(self.model, list(self.shapes))

    def _members(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        others = [k for k in self.groups[name] if k != name]
        if tensor.is_meta:
            state = {f"model.{k}": meta_tensor(self.shapes[k], tensor.dtype) for k in others}
        else:
            state = {f"model.{k}": torch.empty(self.shapes[k], dtype=tensor.dtype) for k in others}
            self.read(state)
        return {name: tensor, **{k[len("model.") :]: v for k, v in state.items()}}

    def __call__(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        if name in self.groups:
            if self.groups[name][0] != name:
                return {}  # written with the group's first tensor
            members = self._members(name, tensor)
            inner = {k: v for n, t in members.items() for k, v in self.inner(n, t).items()}
            return revert_weight_conversion(self.model, inner)
        out = {}
        for key, value in self.inner(name, tensor).items():
            out.update(revert_weight_conversion(self.model, {key: value}))
        return out

    def published_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """What ``save_pretrained`` would write for these in-memory tensors, reverted all at once."""
        from transformers.core_model_loading import revert_weight_conversion

        state = {k: meta_tensor(v, torch.float32) for k, v in shapes.items()}
        return {k: tuple(v.shape) for k, v in revert_weight_conversion(self.model, state).items()}


def check_reload(model: nn.Module, out: str) -> str | None:
    """The written directory, mapped forward by the rules ``from_pretrained`` uses onto ``model`` (a
    fresh meta model), gives exactly its keys with its shapes; else what is missing or unexpected."""
    layout = map_checkpoint(model, header(out))
    gaps = missing(layout, untied_shapes(model))
    if gaps:
        return f"from_pretrained would miss '{gaps[0]}' in the written files"
    if layout.unexpected:
        return f"from_pretrained would not expect '{layout.unexpected[0]}' in the written files"
    return None
