"""What a pipeline stage of the model needs, read off one meta forward of the model's own code.

A stage is the model itself with the blocks of other stages removed (``runtime/pipeline.py``): a
later stage calls the base model's forward with ``inputs_embeds`` set to the hidden states the
previous stage sent, so the model's own code builds the masks and the rotary embeddings from the
position ids on every stage. That is right only where the forward hands ``inputs_embeds`` to the
first block unchanged: one meta forward checks it (a learned position embedding added, a scale or
a dropout there, as in GPT-2, is refused). The same forward tells which of the base model's
children run after the last block (the final norm: the identity on every stage but the last), and
counts the parameters the stages are balanced by (``plan/stages.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from shardlm.errors import ConfigError
from shardlm.parallel.infer.meta_answers import asks_data, meta_answer
from shardlm.parallel.model.meta import build_meta, decoder_blocks
from shardlm.parallel.plan.call_sites import dropout_p, is_dropout_call
from shardlm.parallel.plan.stages import StageLayout, balance

_NOT_YET = "not supported yet (docs/pipeline.md); set parallel.pp: 1"


class _DropoutCount(TorchFunctionMode):
    """Counts dropout calls with p > 0 (``plan/call_sites.py``); answers the data-dependent questions
    a modeling file asks of meta tensors as the trace does (``meta_answers.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if asks_data(name, args):
            return meta_answer(name, args, kwargs)
        if is_dropout_call(func) and dropout_p(func, args, kwargs) > 0:
            self.live += 1
        return func(*args, **kwargs)


def stage_layout(model: nn.Module, stages: int) -> StageLayout:
    """The stages of ``model`` (any built copy: a meta copy is probed); a ``ConfigError`` for what a
    stage cannot be cut from yet."""
    name = type(model).__name__
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        raise ConfigError(f"parallel.pp: {name} has no output embedding for the last stage; {_NOT_YET}")
    names = {id(m): fqn for fqn, m in model.named_modules()}
    blocks = decoder_blocks(model)
    if not blocks:
        raise ConfigError(f"parallel.pp: {name} has no list of repeated decoder blocks to cut into stages; {_NOT_YET}")
    meta = build_meta(model)
    try:
        calls, first_input, dropouts = _probe(meta)
    except Exception as exc:  # noqa: BLE001 - whatever the model's forward says about inputs_embeds
        detail = " ".join(str(exc).split())[:200]
        why = f"its forward cannot start from inputs_embeds ({type(exc).__name__}: {detail})"
        raise ConfigError(
            f"parallel.pp: a later stage of {name} starts from hidden states, but {why}; {_NOT_YET}"
        ) from None
    if "block" not in calls:
        raise ConfigError(f"parallel.pp: {name}'s forward from inputs_embeds never reached its last block; {_NOT_YET}")
    if first_input is not True:
        raise ConfigError(
            f"parallel.pp: {name}'s forward changes the embeddings before its first decoder block (a learned "
            f"position embedding, a scale or a dropout), so a later stage cannot start from the hidden states "
            f"it receives; {_NOT_YET}"
        )
    if dropouts:
        raise ConfigError(
            f"parallel.pp: {name} draws dropout ({dropouts} calls with p > 0 in one forward), whose masks the "
            f"stages do not key yet; set the model's dropout probabilities to 0 in its config.json or parallel.pp: 1"
        )
    base = model.base_model
    children = [fqn for fqn, _ in meta.base_model.named_children()]
    prefix = names[id(base)] + "." if names[id(base)] else ""
    after = tuple(prefix + c for c in calls[calls.index("block") :] if c in children)
    container = next(fqn for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList) and list(m) == blocks)
    _check_cut(model, container, names[id(base)], (emb, *blocks, *(model.get_submodule(f) for f in after), head))
    counts = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    first = sum(p.numel() for p in emb.parameters())
    # tied (held by the first and the last stage, kept equal): the head weighs on the last stage as if untied
    tied = getattr(head, "weight", None) is emb.weight
    split = balance(counts, first, total - sum(counts) - first + (first if tied else 0), stages)
    return StageLayout(split, container, names[id(emb)], after, names[id(head)], tied)


def _check_cut(model: nn.Module, container: str, base: str, kept: tuple[nn.Module, ...]) -> None:
    """The stages are cut from the base model's own children: its block list must be one of them (a
    multimodal wrapper's language model one level down is not handled yet: its final norm and
    ``layer_types`` would be missed), and every parameter must belong to the embedding, a block, what
    runs after the blocks or the head (anything else would be held, and clipped, on every stage)."""
    name = type(model).__name__
    if container.rpartition(".")[0] != base:
        where = base or "the model"
        raise ConfigError(
            f"parallel.pp: {name}'s decoder blocks ({container}) are not a child of its base model ({where}), "
            f"as in a multimodal checkpoint's language_model; {_NOT_YET}"
        )
    placed = {id(p) for m in kept for p in m.parameters()}
    left = [fqn for fqn, p in model.named_parameters() if id(p) not in placed]
    if left:
        raise ConfigError(
            f"parallel.pp: {name} has parameters outside its embedding, blocks, final modules and head "
            f"({left[0]}{f' and {len(left) - 1} more' if len(left) > 1 else ''}), which every stage would hold; "
            f"{_NOT_YET}"
        )


def _probe(meta: nn.Module) -> tuple[list[str], bool | None, int]:
    """One training-mode forward of ``meta``'s base model from ``inputs_embeds``: the base model's
    children in call order (every block called as ``"block"``, once, after the last one), whether the
    first block received ``inputs_embeds`` itself, and the dropout calls with p > 0."""
    base, blocks = meta.base_model, decoder_blocks(meta)
    calls: list[str] = []
    seen: dict[str, bool | None] = {"first": None}
    hooks = [
        child.register_forward_pre_hook(lambda m, a, fqn=fqn: calls.append(fqn))
        for fqn, child in base.named_children()
        if not isinstance(child, nn.ModuleList)
    ]
    hidden = torch.zeros(1, 4, meta.get_input_embeddings().weight.shape[1], device="meta")

    def first_block(module, args, kwargs):
        got = args[0] if args else kwargs.get("hidden_states")
        seen["first"] = got is hidden

    def last_block(module, args, output):
        calls.append("block")

    hooks.append(blocks[0].register_forward_pre_hook(first_block, with_kwargs=True))
    hooks.append(blocks[-1].register_forward_hook(last_block))
    count = _DropoutCount()
    try:
        meta.train()
        with count, torch.no_grad():
            base(inputs_embeds=hidden)
    finally:
        for hook in hooks:
            hook.remove()
    return calls, seen["first"], count.live
