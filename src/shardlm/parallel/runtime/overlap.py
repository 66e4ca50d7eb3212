"""The column-parallel layers' weight gradients computed while their input gradient's all-reduce is in
flight: Megatron-LM's ``async_tensor_model_parallel_allreduce`` (``LinearWithGradAccumulationAndAsyncCommunication``:
input gradient, all-reduce issued async, weight gradient, wait).

Here the readers of one activation share one region input and one all-reduce (``linear.column_input``:
q/k/v, gate/up), so the all-reduce can start only once every reader's input gradient is in, when the
region's own backward (``regions.copy_to_region``) runs; by then autograd would have computed every
reader's weight gradient in the reader's own node. So a reader (``ColumnLinear``) computes its input
gradient only and leaves its weight and bias gradients to its region (``ColumnRegion``), whose backward
issues the all-reduce, computes them, hands them to autograd (a reentrant ``torch.autograd.backward`` on
the same weight views: the parameters' own accumulation, ``shards.local_view``'s DTensor wrapping, and
every hook run as before) and only then waits. Same ops on the same operands in the layout autograd's
``mm`` backward uses: the numbers are the same, and so are the collectives.

A reader defers only when the region's backward runs in the same backward and that backward accumulates
into the parameters (``loss.backward()``); otherwise (``torch.autograd.grad`` capturing the parameters,
pipelining's input-only pass, a region whose input needs no gradient, a compiled block) it computes its
weight gradient itself, as ``nn.functional.linear``'s backward would.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge


class ColumnRegion:
    """The weight-gradient work the readers of one region input left for its backward."""

    __slots__ = ("deferred",)

    def __init__(self) -> None:
        # (output gradient 2-D, input 2-D, weight view, bias view or None, conv1d, wants weight, wants bias)
        self.deferred: list[tuple] = []

    def run_deferred(self) -> None:
        """The deferred weight and bias gradients, given to autograd in one reentrant backward."""
        tensors, grads = [], []
        while self.deferred:
            g2, x2, weight, bias, conv1d, want_w, want_b = self.deferred.pop()
            if want_w:
                tensors.append(weight)
                grads.append(x2.t().mm(g2) if conv1d else g2.t().mm(x2))
            if want_b:
                tensors.append(bias)
                grads.append(g2.sum(0))
        if tensors:
            torch.autograd.backward(tensors, grads)


def _accumulates(param: torch.Tensor) -> bool:
    """This backward accumulates ``param``'s gradient into ``.grad`` (not ``autograd.grad`` capturing it)."""
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(param).node)
    except RuntimeError:  # autograd.grad with the parameter among its inputs
        return False


class ColumnLinear(torch.autograd.Function):
    """``linear`` (or GPT-2's ``Conv1D``: ``x @ weight``) of a region input ``x`` (``region``'s) on the
    weight and bias views of ``params``; backward: the input gradient, the weight's left to the region."""

    @staticmethod
    def forward(ctx, x, weight, bias, region: ColumnRegion, params: tuple, conv1d: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.region, ctx.params, ctx.conv1d = bias, region, params, conv1d
        if conv1d:
            flat = x.reshape(-1, x.shape[-1])
            out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
            return out.view(*x.shape[:-1], weight.shape[1])
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = (g2.mm(weight.t()) if ctx.conv1d else g2.mm(weight)).view(x.shape)
        want_w = ctx.needs_input_grad[1]
        want_b = ctx.bias is not None and ctx.needs_input_grad[2]
        if not (want_w or want_b):
            return grad_x, None, None, None, None, None
        x2 = x.reshape(-1, x.shape[-1])
        work = (g2, x2, weight, ctx.bias, ctx.conv1d, want_w, want_b)
        region_node = ctx.next_functions[0][0]
        if (
            getattr(region_node, "region", None) is ctx.region
            and torch._C._will_engine_execute_node(region_node)
            and all(_accumulates(p) for p, want in zip(ctx.params, (want_w, want_b), strict=True) if want)
        ):
            ctx.region.deferred.append(work)
            return grad_x, None, None, None, None, None
        grad_w = (x2.t().mm(g2) if ctx.conv1d else g2.t().mm(x2)) if want_w else None
        return grad_x, grad_w, g2.sum(0) if want_b else None, None, None, None
