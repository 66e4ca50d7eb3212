"""Sequence parallelism at run time (``parallel.sequence_parallel``; where, derived from the plan:
``plan/sequence.py``): forward hooks that move the residual stream into and out of its sequence slices.

* the first decoder block's input: this rank's slice (``scatter_to_sequence_region``; backward all-gather);
* each gathered sub-block's input (``plan.sequence.sequence_entries``): the whole sequence, shared by its
  column-parallel readers (``linear.gathered_input``; backward reduce-scatter); hooked before the
  styles' own input hooks, so a column-parallel layer sitting directly in a block reads it too;
* its row-parallel outputs reduce-scatter instead of all-reducing (``plan_styles.make_style``);
* a mixture-of-experts block (``plan.sequence.whole_entries``): its input gathered whole
  (``gather_from_sequence_region``: its gradient, summed over TP inside the block, sliced on the way
  back), its output sliced again (``scatter_to_sequence_region``);
* the last decoder block's output: the whole sequence again (``gather_from_sequence_region``), for the
  final norm and the vocabulary-parallel LM head.

Each hook also tells the dropout masks whether the stream is in its slices (``dropout.set_sequence_region``):
the model's and every block's entry, every sub-block's entry and row-parallel layer's exit, so a block recomputed by
activation checkpointing draws its forward's masks.

The norms in between compute on the slices: their gradients are partial, summed over TP with the
other TP-partial gradients (``grads.tp_partial_grad_params``, ``plan.sequence.sequence_norms``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardlm.errors import ConfigError
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.sequence import (
    block_names,
    scattered_rows,
    sequence_entries,
    sequence_refusal,
    whole_entries,
)
from shardlm.parallel.runtime.dropout import set_sequence_region
from shardlm.parallel.runtime.linear import gathered_input
from shardlm.parallel.runtime.regions import gather_from_sequence_region, scatter_to_sequence_region


def apply_sequence_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Register the hooks of the module docstring on ``model`` (TP already applied on ``mesh``); a plan
    they cannot serve is refused here too (preflight refuses it first for ``shardlm train``)."""
    why = sequence_refusal(model, plan)
    if why is not None:
        raise ConfigError(f"parallel.sequence_parallel=true cannot run this model: {why}")
    blocks = block_names(model)

    def enter(module, args, kwargs):
        set_sequence_region(True)
        return _map_hidden(args, kwargs, lambda x: scatter_to_sequence_region(x, mesh))

    def gather(module, args, kwargs):
        set_sequence_region(False)
        return _map_hidden(args, kwargs, lambda x: gathered_input(x, mesh))

    def gather_whole(module, args, kwargs):
        set_sequence_region(False)
        return _map_hidden(args, kwargs, lambda x: gather_from_sequence_region(x, mesh))

    def leave(module, args, out):
        set_sequence_region(False)
        return _map_output(out, lambda x: gather_from_sequence_region(x, mesh))

    def scatter(module, args, out):
        set_sequence_region(True)
        return _map_output(out, lambda x: scatter_to_sequence_region(x, mesh))

    for i, block in enumerate(blocks):  # each block says where the stream is (a recomputed block too)
        first, last = i == 0, i == len(blocks) - 1
        module = model.get_submodule(block)
        module.register_forward_pre_hook(enter if first else _region_hook(True), with_kwargs=True)
        module.register_forward_hook(leave if last else _region_hook(False, with_out=True))
    model.register_forward_pre_hook(_region_hook(False), with_kwargs=True)  # the embeddings: whole
    for entry in sequence_entries(model, plan):
        model.get_submodule(entry).register_forward_pre_hook(gather, with_kwargs=True, prepend=True)
    for fqn in scattered_rows(model, plan):  # dropout after a row-parallel output acts on the slices
        model.get_submodule(fqn).register_forward_hook(_region_hook(True, with_out=True))
    for entry in whole_entries(plan):
        model.get_submodule(entry).register_forward_pre_hook(gather_whole, with_kwargs=True, prepend=True)
        model.get_submodule(entry).register_forward_hook(scatter)


def _region_hook(on: bool, with_out: bool = False) -> Callable:
    """A forward (pre-)hook that only says whether the stream is in its sequence slices."""
    if with_out:
        return lambda module, args, out: set_sequence_region(on)
    return lambda module, args, kwargs: set_sequence_region(on)


def _map_output(out, fn: Callable[[torch.Tensor], torch.Tensor]):
    """A module's output with ``fn`` applied to the hidden states: the tensor, or a tuple's first."""
    return fn(out) if isinstance(out, torch.Tensor) else (fn(out[0]), *out[1:])


def _map_hidden(args: tuple, kwargs: dict, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with ``fn`` applied to the hidden states: the first positional argument, or
    the ``hidden_states`` keyword."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
