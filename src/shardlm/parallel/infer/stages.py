"""What a pipeline stage of the model needs, read off one meta forward of the model's own code.

A stage is the model itself with the blocks of other stages removed (``runtime/pipeline.py``): a
later stage calls the base model's forward with ``inputs_embeds`` set to the hidden states the
previous stage sent, so the model's own code builds the masks and the rotary embeddings from the
position ids on every stage. Where the forward changes the embeddings before the first block (GPT-2
adds its learned position embedding, Granite scales, an embedding dropout), the first stage runs that
part of the forward as the model does and a later stage replaces the first block's input by the
hidden states it received; the modules with parameters that run there are the first stage's (a later
one gets stand-ins). One meta forward from ``inputs_embeds`` tells which children run before the first
block and after the last (the final norm: the identity on every stage but the last), whether the
first block gets ``inputs_embeds`` unchanged, and that no other input of any block is computed from the
embeddings, a parameter or an earlier block (which a later stage could not rebuild: refused; Inkling 2
carries a second stream of block states from block to block). It also counts
the parameters the stages are balanced by (``plan/stages.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from shardlm.errors import ConfigError
from shardlm.parallel.infer.meta_answers import asks_data, meta_answer
from shardlm.parallel.model.meta import build_meta, decoder_blocks
from shardlm.parallel.plan.call_sites import dropout_p, is_call_site
from shardlm.parallel.plan.stages import StageLayout, balance

_NOT_YET = "not supported yet (docs/pipeline.md); set parallel.pp: 1"


class _DropoutCount(TorchFunctionMode):
    """Counts the call sites ``DeterministicDropout`` keys (``plan/call_sites.py``): dropout calls and a
    router's random draws (Phi-MoE's Gumbel sampling, Mixtral's jitter), and those that draw (p > 0, every
    random draw); answers the data-dependent questions a modeling file asks of meta tensors as the trace
    does (``meta_answers.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.calls = 0  # every call site, whatever its p: what ``DeterministicDropout`` numbers its sites by

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if asks_data(name, args):
            return meta_answer(name, args, kwargs)
        if is_call_site(func):
            self.calls += 1
            self.live += dropout_p(func, args, kwargs) > 0
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
    seen = _read_forward(model)
    base = model.base_model
    prefix = names[id(base)] + "." if names[id(base)] else ""
    children = dict(base.named_children())
    # the base model's children with parameters run before the first block (GPT-2's position embedding):
    # the first stage's; a later one gets a stand-in, its output replaced at its first block (runtime/pipeline.py)
    before = [c for c in seen.calls[: seen.calls.index("first")] if c in children and _has_params(children[c])]
    after = [c for c in seen.calls[seen.calls.index("block") :] if c in children]
    before, after = tuple(prefix + c for c in before), tuple(prefix + c for c in after)
    container = next(fqn for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList) and list(m) == blocks)
    ends = (emb, *(model.get_submodule(f) for f in before), *(model.get_submodule(f) for f in after), head)
    _check_cut(model, container, names[id(base)], (*blocks, *ends))
    counts = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    first = sum(p.numel() for m in (emb, *(model.get_submodule(f) for f in before)) for p in m.parameters())
    # tied (held by the first and the last stage, kept equal): the head weighs on the last stage as if untied
    tied = getattr(head, "weight", None) is emb.weight
    last = total - sum(counts) - first + (sum(p.numel() for p in emb.parameters()) if tied else 0)
    split = balance(counts, first, last, stages)
    sites = _dropout_sites(build_meta(model)) if seen.dropouts else ()  # where each stage's masks resume
    layout = StageLayout(split, container, names[id(emb)], after, names[id(head)], tied, before, not seen.unchanged)
    return replace(layout, sites=sites)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _read_forward(model: nn.Module) -> _Forward:
    """One meta forward of ``model`` from ``inputs_embeds`` (``_probe``); a ``ConfigError`` where a later
    stage could not start from the hidden states it receives."""
    name = type(model).__name__
    try:
        seen = _probe(build_meta(model))
    except Exception as exc:  # noqa: BLE001 - whatever the model's forward says about inputs_embeds
        detail = " ".join(str(exc).split())[:200]
        why = f"its forward cannot start from inputs_embeds ({type(exc).__name__}: {detail})"
        raise ConfigError(
            f"parallel.pp: a later stage of {name} starts from hidden states, but {why}; {_NOT_YET}"
        ) from None
    if "block" not in seen.calls:
        raise ConfigError(f"parallel.pp: {name}'s forward from inputs_embeds never reached its last block; {_NOT_YET}")
    if seen.derived is not None:  # Zamba's original hidden states; Inkling 2's block states, a second stream
        raise ConfigError(
            f"parallel.pp: {name}'s {seen.derived}, computed before it from the embeddings, a "
            f"parameter or an earlier block, which a later stage could not rebuild from the hidden states it "
            f"receives; {_NOT_YET}"
        )
    return seen


def _dropout_sites(meta: nn.Module) -> tuple[int, ...]:
    """The call sites (``DeterministicDropout``'s count: dropout calls and a router's random draws) one
    process's training forward from ``input_ids`` has made when it enters each decoder block: where a later
    stage's count resumes."""
    blocks, count = decoder_blocks(meta), _DropoutCount()
    sites: list[int] = []
    hooks = [block.register_forward_pre_hook(lambda m, a: sites.append(count.calls)) for block in blocks]
    try:
        meta.train()
        with count, torch.no_grad():
            meta(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"))
    finally:
        for hook in hooks:
            hook.remove()
    return tuple(sites)


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


@dataclass
class _Forward:
    """What one meta forward of the base model from ``inputs_embeds`` showed: ``calls``, the base
    model's children in call order (``"first"`` at the first block's entry, ``"block"`` after the last
    block); ``unchanged``, whether the first block received ``inputs_embeds`` itself; ``derived``, which
    block is handed which input, the first other than its hidden states that depends on ``inputs_embeds``,
    a parameter or an earlier block (None: none does); ``dropouts``, the dropout calls with p > 0 and the
    random draws."""

    calls: list[str] = field(default_factory=list)
    unchanged: bool | None = None
    derived: str | None = None
    dropouts: int = 0


def _tensors(value):
    """The tensors in ``value`` (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _probe(meta: nn.Module) -> _Forward:
    """One training-mode forward of ``meta``'s base model from ``inputs_embeds`` (which, like every
    parameter, requires grad, so what is computed from them shows it), read by module hooks."""
    base, blocks = meta.base_model, decoder_blocks(meta)
    seen = _Forward()
    hooks = [
        child.register_forward_pre_hook(lambda m, a, fqn=fqn: seen.calls.append(fqn))
        for fqn, child in base.named_children()
        if not isinstance(child, nn.ModuleList)
    ]
    width = meta.get_input_embeddings().weight.shape[1]
    hidden = torch.zeros(1, 4, width, device="meta", requires_grad=True).clone()  # not a leaf: in-place ops work

    def block_inputs(module, args, kwargs):
        got = args[0] if args else kwargs.get("hidden_states")
        if module is blocks[0]:
            seen.calls.append("first")
            seen.unchanged = got is hidden
        others = {f"argument {i}": a for i, a in enumerate(args[1:], start=1)} if args else {}
        others.update({k: v for k, v in kwargs.items() if args or k != "hidden_states"})
        derived = next((k for k, v in others.items() if any(t.requires_grad for t in _tensors(v))), None)
        if derived is not None and seen.derived is None:
            index = blocks.index(module)
            seen.derived = f"{'first decoder block' if index == 0 else f'decoder block {index}'} is handed {derived}"

    def last_block(module, args, output):
        seen.calls.append("block")

    hooks += [block.register_forward_pre_hook(block_inputs, with_kwargs=True) for block in blocks]
    hooks.append(blocks[-1].register_forward_hook(last_block))
    count = _DropoutCount()
    try:
        meta.train()
        with count, torch.enable_grad():
            base(inputs_embeds=hidden)
    finally:
        for hook in hooks:
            hook.remove()
    seen.dropouts = count.live
    return seen
