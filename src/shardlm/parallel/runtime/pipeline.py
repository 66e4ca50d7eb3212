"""One pipeline stage (``parallel.pp``): the model itself with the other stages' modules removed, and
the module ``torch.distributed.pipelining``'s ``PipelineStage`` runs.

Why the model itself and not a traced graph: torch's ``pipeline()`` tracer fails on HF models with
rotary embeddings (pytorch#184361), and a rewritten forward would drift from the model's. Here each
stage calls the model's own forward: the first stage from ``input_ids``, a later one from the
hidden states it received as ``inputs_embeds`` (``infer/stages.py`` checked that the forward hands
them to the first block unchanged), so the masks (causal, sliding window, the block-diagonal mask of
packed documents) and the rotary embeddings are built by the model's code from the position ids
every stage is given. A stage keeps its blocks under their own indices (``StageBlocks``), so every
parameter keeps the FQN it has in the whole model; the final norm is the identity before the last
stage, and the config's list of per-block kinds (``layer_types``, read by block position in the
forwards of Qwen3 or Gemma 3) is cut to the stage's.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import nullcontext

import torch
from torch import nn

from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.stages import StageLayout


class StageBlocks(nn.ModuleList):
    """The decoder blocks of one stage, registered under their indices in the whole model (``layers.2``,
    ``layers.3``): FQNs, checkpoints and the seeded init see the whole model's names. Iteration and
    slicing (what the models' forwards do) give the stage's blocks in order."""

    def __init__(self, modules=None, indices: range | None = None) -> None:
        super().__init__()
        for i, module in zip(indices or range(len(modules or [])), modules or []):
            self.add_module(str(i), module)


def keep_stage(model: nn.Module, layout: StageLayout, stage: int) -> None:
    """Cut ``model`` (built on meta, before any placement) down to stage ``stage`` of ``layout``, in place."""
    first, last = stage == 0, stage == layout.split.stages - 1
    indices = layout.split.blocks[stage]
    parent, name = _parent(model, layout.blocks)
    blocks = getattr(parent, name)
    setattr(parent, name, StageBlocks([blocks[i] for i in indices], indices))
    base = model.base_model
    config = copy.copy(base.config)  # the base model's own copy: the top-level config stays the whole model's
    if isinstance(getattr(config, "layer_types", None), list):  # read by block position: ``layer_types[i]``
        config.layer_types = [config.layer_types[i] for i in indices]
    config.num_hidden_layers = len(indices)
    base.config = config
    if not first:
        _set(model, layout.embedding, None)
    if not last:
        for fqn in layout.after:
            _set(model, fqn, nn.Identity())
        _set(model, layout.head, None)


# the plan's fields keyed (or listed) by a module or parameter fqn; the others (``dropout_sites``, by call order,
# ``kv_heads``, ``geometry``) are the whole model's and hold on every stage as they are
_FQN_FIELDS = (
    "styles", "parts", "whole_parts", "attention", "agrees_with_hf", "sliced", "replicated", "experts", "channels",
    "channel_parts", "channel_rows", "local_sizes", "latent_readers", "summed", "head_inputs",
)  # fmt: skip


def stage_plan(plan: Plan, model: nn.Module) -> Plan:
    """The TP plan of the whole model (inferred before the cut, so every stage splits its blocks as the
    whole model would) narrowed to the modules and parameters ``model``'s stage holds: the styles, the
    geometry and the gradient sums read its entries by name, and another stage's modules are not here (the
    final norm before the last stage is the identity ``keep_stage`` put in its place)."""
    here = {name for name, m in model.named_modules() if not isinstance(m, nn.Identity)}
    here |= {name for name, _ in model.named_parameters()}
    narrowed = {}
    for name in _FQN_FIELDS:
        value = getattr(plan, name)
        if isinstance(value, dict):
            narrowed[name] = {fqn: entry for fqn, entry in value.items() if fqn in here}
        else:
            narrowed[name] = [fqn for fqn in value if fqn in here]
    return dataclasses.replace(plan, **narrowed)


def _parent(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    owner, _, name = fqn.rpartition(".")
    return (model.get_submodule(owner) if owner else model), name


def _set(model: nn.Module, fqn: str, module: nn.Module | None) -> None:
    parent, name = _parent(model, fqn)
    setattr(parent, name, module)


class PipelineStageModule(nn.Module):
    """What ``PipelineStage`` runs for stage ``stage`` of ``stages``: ``input_ids`` (first stage) or the
    previous stage's hidden states in, the hidden states (or, on the last stage, the logits) out.
    ``position_ids`` reach every stage from the schedule's keyword arguments (each data-parallel
    rank's stages read the same batch), so only the hidden states travel between stages.
    ``autocast``: the device type to run the forward under bf16 autocast (``train.bf16`` where FSDP
    does not cast, as the trainer's own forward does), or None."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        self.model = model
        self.first, self.last = stage == 0, stage == stages - 1
        self.autocast: str | None = None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        inputs = {"input_ids" if self.first else "inputs_embeds": x}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        with torch.autocast(self.autocast, dtype=torch.bfloat16) if self.autocast else nullcontext():
            if self.last:
                return self.model(**inputs).logits
            return self.model.base_model(**inputs).last_hidden_state
