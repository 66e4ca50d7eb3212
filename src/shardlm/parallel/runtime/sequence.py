"""Sequence parallelism at run time (``parallel.sequence_parallel``; where, derived from the plan:
``plan/sequence.py``): forward hooks that move the residual stream into and out of its sequence slices.

* the first decoder block's input: this rank's slice (``scatter_to_sequence_region``; backward all-gather;
  where the embedding reduce-scattered, ``plan.sequence.stream_ends``: ``own_sequence_slice``, no communication);
* each gathered sub-block's input (``plan.sequence.sequence_entries``): the whole sequence, shared by its
  column-parallel readers (``linear.gathered_input``; backward reduce-scatter); hooked before the
  styles' own input hooks, so a column-parallel layer sitting directly in a block reads it too;
* its row-parallel outputs reduce-scatter instead of all-reducing (``plan_styles.make_style``);
* a mixture-of-experts block (``plan.sequence.whole_entries``): its input gathered whole
  (``gather_from_sequence_region``: its gradient, summed over TP inside the block, sliced on the way
  back), its output sliced again (``scatter_to_sequence_region``);
* the last decoder block's output: the whole sequence again (``gather_from_sequence_region``), for the
  final norm and the vocabulary-parallel LM head; where ``stream_ends`` holds, the final norm computes on
  the slices and the LM head's input is gathered instead, as a column-parallel layer's (``gathered_input``).

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
    stream_ends,
    whole_entries,
)
from shardlm.parallel.runtime.dropout import set_sequence_region
from shardlm.parallel.runtime.linear import gathered_input
from shardlm.parallel.runtime.regions import (
    gather_from_sequence_region,
    own_sequence_slice,
    scatter_to_sequence_region,
)


def apply_sequence_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Register the hooks of the module docstring on ``model`` (TP already applied on ``mesh``); a plan
    they cannot serve is refused here too (preflight refuses it first for ``shardlm train``)."""
    why = sequence_refusal(model, plan)
    if why is not None:
        raise ConfigError(f"parallel.sequence_parallel=true cannot run this model: {why}")
    blocks, ends = block_names(model), stream_ends(model, plan)
    slicing = own_sequence_slice if ends is not None else scatter_to_sequence_region

    def enter(module, args, kwargs):
        set_sequence_region(True)
        return _map_hidden(args, kwargs, lambda x: slicing(x, mesh))

    def gather(module, args, kwargs):
        set_sequence_region(False)
        return _map_hidden(args, kwargs, lambda x: gathered_input(x, mesh))

    def gather_whole(module, args, kwargs):
        set_sequence_region(False)
        return _map_hidden(args, kwargs, lambda x: gather_from_sequence_region(x, mesh))

    def leave(module, args, out):
        set_sequence_region(ends is not None)  # the final norm on the slices, or the whole sequence again
        return out if ends is not None else _map_output(out, lambda x: gather_from_sequence_region(x, mesh))

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
    if ends is not None:
        _stream_ends_hooks(model, ends, blocks[-1], gather)
    for entry in whole_entries(plan):
        model.get_submodule(entry).register_forward_pre_hook(gather_whole, with_kwargs=True, prepend=True)
        model.get_submodule(entry).register_forward_hook(scatter)


def _stream_ends_hooks(model: nn.Module, ends: tuple[str, str | None, str], last: str, gather: Callable) -> None:
    """Where the stream stays in its slices up to the LM head (``stream_ends``): its input gathered as a
    column-parallel layer's; the final norm checked to run after the blocks (on the slices), not before."""
    model.get_submodule(ends[2]).register_forward_pre_hook(gather, with_kwargs=True, prepend=True)
    if ends[1] is None:
        return
    done: list[bool] = [False]
    model.register_forward_pre_hook(lambda module, args, kwargs: done.__setitem__(0, False), with_kwargs=True)
    model.get_submodule(last).register_forward_hook(lambda module, args, out: done.__setitem__(0, True))

    def check(module, args):
        if not done[0]:
            raise RuntimeError(
                f"sequence parallelism: {ends[1]}, taken for the final norm, ran before the last decoder block; "
                "its input would hold only this rank's positions (plan.sequence.stream_ends)"
            )

    model.get_submodule(ends[1]).register_forward_pre_hook(check)


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
