"""One pipeline stage (``parallel.pp``): the model itself with the other stages' modules removed, and
the module ``torch.distributed.pipelining``'s ``PipelineStage`` runs.

Why the model itself and not a traced graph: torch's ``pipeline()`` tracer fails on HF models with
rotary embeddings (pytorch#184361), and a rewritten forward would drift from the model's. Here each
stage calls the model's own forward: the first stage from ``input_ids``, a later one from the
hidden states it received as ``inputs_embeds``, so the masks (causal, sliding window, the block-diagonal mask of
packed documents) and the rotary embeddings are built by the model's code from the position ids
every stage is given. Where the forward changes the embeddings before the first block
(``StageLayout.restarts``: GPT-2's position embedding added, a scale, a dropout), the first stage runs
that part as the model does; a later stage runs it on what it received, through parameterless
stand-ins (``Discarded``) of the modules with parameters there, and a hook hands its first block the
hidden states received instead. A stage keeps its blocks under their own indices (``StageBlocks``), so every
parameter keeps the FQN it has in the whole model; the final norm is the identity before the last
stage, and the config's list of per-block kinds (``layer_types``, read by block position in the
forwards of Qwen3 or Gemma 3) is cut to the stage's. Tied embeddings (``StageLayout.tied``): the last
stage keeps the input embedding module too, holding the one weight it shares with the head under the
same names as the first stage (``PipelineStageModule.shared`` names it on both; their gradients are
summed between the two, ``train/pipeline_step.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace

import torch
from torch import nn

from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.stages import StageLayout
from shardlm.parallel.runtime.context import ContextShard, context_parallel
from shardlm.parallel.runtime.dropout import DeterministicDropout, DropoutKey, resume_at


class StageBlocks(nn.ModuleList):
    """The decoder blocks of one stage, registered under their indices in the whole model (``layers.2``,
    ``layers.3``): FQNs, checkpoints and the seeded init see the whole model's names. Iteration and
    slicing (what the models' forwards do) give the stage's blocks in order."""

    def __init__(self, modules=None, indices: Sequence[int] | None = None) -> None:
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
    if not first and not (last and layout.tied):  # the last stage's head uses a tied embedding's weight
        _set(model, layout.embedding, None)
    if not first:  # what the first stage ran before its first block: computed here only to be replaced
        for fqn in layout.before:
            _set(model, fqn, Discarded(model.get_submodule(fqn)))
    if not last:
        for fqn in layout.after:
            _set(model, fqn, nn.Identity())
        _set(model, layout.head, None)


# the plan's fields keyed (or listed) by a module or parameter fqn; the others (``dropout_sites``, by call order,
# ``kv_heads``, ``geometry``) are the whole model's and hold on every stage as they are
_FQN_FIELDS = (
    "styles", "parts", "whole_parts", "attention", "agrees_with_hf", "sliced", "stored_rows", "replicated", "experts",
    "channels", "channel_parts", "channel_rows", "local_sizes", "latent_readers", "summed", "head_inputs",
    "partial_grads", "indexers", "direct_reads", "narrowed", "unrun", "shared_kv", "local_reshapes",
    "head_einsums", "channel_dims",
)  # fmt: skip


def stage_plan(plan: Plan, model: nn.Module) -> Plan:
    """The TP plan of the whole model (inferred before the cut, so every stage splits its blocks as the
    whole model would) narrowed to the modules and parameters ``model``'s stage holds: the styles, the
    geometry and the gradient sums read its entries by name, and another stage's modules are not here (the
    final norm before the last stage is the identity ``keep_stage`` put in its place)."""
    here = {name for name, m in model.named_modules() if not isinstance(m, (nn.Identity, Discarded))}
    here |= {name for name, _ in model.named_parameters()}
    narrowed = {}
    for name in _FQN_FIELDS:
        value = getattr(plan, name)
        if isinstance(value, dict):
            narrowed[name] = {fqn: entry for fqn, entry in value.items() if fqn in here}
        else:
            narrowed[name] = [fqn for fqn in value if fqn in here]
    return dataclasses.replace(plan, **narrowed)


class Discarded(nn.Module):
    """A later stage's stand-in for a module with parameters the model's forward runs before the first
    block (GPT-2's position embedding): zeros of the shape and dtype the module gives (run on the meta
    copy it keeps unregistered, so the stage holds none of its parameters). What the forward makes of
    them before the first block is replaced there by the hidden states the stage received."""

    def __init__(self, meta: nn.Module) -> None:
        super().__init__()
        self.meta = (meta,)  # a tuple: not a submodule, its parameters stay the first stage's

    def forward(self, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")

        def on_meta(a):
            return a.to("meta") if isinstance(a, torch.Tensor) else a

        out = self.meta[0](*map(on_meta, args), **{k: on_meta(v) for k, v in kwargs.items()})
        return torch.zeros(out.shape, dtype=out.dtype, device=device)


def _lora_dropout(model: nn.Module) -> bool:
    """Whether peft's adapters in ``model`` drop their input in training (``lora.dropout`` > 0)."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 and ".lora_dropout." in f".{n}." for n, m in model.named_modules())


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
    does not cast, as the trainer's own forward does), or None. ``shared``: the names of the parameters
    this stage holds in a copy another stage holds too (a tied embedding's weight on the first and the
    last stage), whose gradients the two sum."""

    def __init__(self, model: nn.Module, layout: StageLayout, stage: int) -> None:
        super().__init__()
        self.model = model
        self.index = stage
        self.first, self.last = stage == 0, stage == layout.split.stages - 1
        self.autocast: str | None = None
        self.context: tuple | None = None  # under parallel.cp: ContextShard's (cp, rank, group, attention)
        self.tied = layout.tied
        # the model's own dropout (its call sites counted, ``layout.sites``) or peft's LoRA dropout (sites of
        # their own, ``runtime/dropout.py: lora_dropout_sites``): the micro-batches' sample positions are needed
        self.draws_dropout = bool(layout.sites) or _lora_dropout(model)
        self.received: torch.Tensor | None = None  # the hidden states this forward started from
        first_block = next(iter(model.get_submodule(layout.blocks)))
        if layout.restarts and not self.first:
            first_block.register_forward_pre_hook(self._restart, with_kwargs=True)
        self.dropout: DropoutKey | None = None  # the step's dropout key while the schedule runs (positions: per call)
        if layout.sites and not self.first:  # the masks resume where one process's count is at this block
            site = layout.sites[layout.split.blocks[stage].start]
            first_block.register_forward_pre_hook(lambda module, args: resume_at(site))
        held = layout.tied and (self.first or self.last) and not (self.first and self.last)
        emb = model.get_submodule(layout.embedding) if held else None
        self.shared = tuple(f"{layout.embedding}.{n}" for n, _ in emb.named_parameters()) if held else ()

    def _restart(self, block: nn.Module, args: tuple, kwargs: dict):
        """The first block's input replaced by the hidden states the stage received. Module hooks run
        outside an activation-checkpointed block's checkpoint (transformers' ``GradientCheckpointingLayer``
        checkpoints ``forward``, not ``__call__``), so its recompute gets the same input again."""
        if args:
            return (self.received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.received}

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        samples: torch.Tensor | None = None,
        window: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``samples``: the micro-batch's positions in the global batch, which its dropout masks are keyed by
        (``runtime/dropout.py``), while ``dropout`` holds the step's key. ``window``: under context
        parallelism, the position ids of the micro-batch's whole windows (``x`` and ``position_ids`` hold
        this rank's tokens of them): the shard its attention gathers the other cp ranks' keys and values
        over (``runtime/context.py``), as the trainer's micro-step does without stages."""
        self.received = x
        inputs = {"input_ids" if self.first else "inputs_embeds": x}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        drop = self.dropout is not None and samples is not None
        mode = DeterministicDropout(replace(self.dropout, positions=samples)) if drop else nullcontext()
        autocast = torch.autocast(self.autocast, dtype=torch.bfloat16) if self.autocast else nullcontext()
        shard = ContextShard(window, *self.context) if window is not None and self.context else None
        with context_parallel(shard), mode, autocast:
            if self.last:
                return self.model(**inputs).logits
            hidden = self.model.base_model(**inputs).last_hidden_state
        # The zero-bubble schedules' input pass detaches a stage's output in place once its gradient is taken
        # (torch's ``stage_backward_input``), which a view cannot be: GPT-2's forward ends in a ``view``.
        return hidden.clone() if hidden._is_view() else hidden


class RankStages(nn.ModuleList):
    """The stage modules one rank runs under a schedule with several stages a rank (``parallel.pp_schedule``
    Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble), in stage order: each an unmodified slice of
    its own copy of the model (``keep_stage``), as torchtitan builds its model chunks."""


def tie_on_one_rank(stages: RankStages, layout: StageLayout) -> None:
    """A tied weight whose first and last stage are both this rank's (``ZBVZeroBubble``'s V puts them on rank
    0): the last stage's copy replaced by the first stage's parameter itself, in the embedding module and
    the head it shares with, so the two uses accumulate into one gradient as in one process; neither stage
    then has a copy to sum with another rank (``shared`` empty), and the norm counts the one parameter."""
    first = next(s for s in stages if s.first)
    last = next(s for s in stages if s.last)
    weight = first.model.get_submodule(layout.embedding).weight
    for fqn in (layout.embedding, layout.head):
        last.model.get_submodule(fqn).weight = weight
    first.shared = last.shared = ()


def join_stages(stages: RankStages, layout: StageLayout) -> nn.Module:
    """One module holding every parameter of ``stages`` under the whole model's names, for what sees this
    rank's part of the model as one (the optimizer, checkpoints, clipping, the parameter count): the first
    stage module's model with its base model's block list holding all the stages' blocks, and the
    embedding (and the modules before the blocks) of the first stage, the modules after the blocks and
    the head of the last, where this rank holds them. It shares the stages' modules and is never run."""
    models = [stage.model for stage in stages]
    first = next((s.model for s in stages if s.first), models[0])
    last = next((s.model for s in stages if s.last), models[0])
    top = _shallow(models[0])
    base_fqn, _, list_name = layout.blocks.rpartition(".")
    base = _shallow(models[0].get_submodule(base_fqn)) if base_fqn else top
    if base_fqn:
        _set(top, base_fqn, base)
    blocks = [(int(i), b) for m in models for i, b in m.get_submodule(layout.blocks).named_children()]
    setattr(base, list_name, StageBlocks([b for _, b in blocks], [i for i, _ in blocks]))
    for fqns, source in (((layout.embedding, *layout.before), first), ((*layout.after, layout.head), last)):
        for fqn in fqns:  # from the stage that runs it, else any that holds it (a tied embedding on the last)
            held = next((m for m in (source, *models) if _present(m, fqn)), None)
            _set(top, fqn, held.get_submodule(fqn) if held is not None else None)
    return top


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its parameters and children, with a children's table of its own."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # noqa: SLF001 - torch's own table of children, copied
    return clone


def _present(model: nn.Module, fqn: str) -> bool:
    parent, name = _parent(model, fqn)
    return getattr(parent, name, None) is not None
