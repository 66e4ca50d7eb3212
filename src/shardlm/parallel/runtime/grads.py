"""TP-partial gradients: what each TP rank holds only a partial sum of, and the sums over TP.

The one list of them (``tp_partial_grad_params``): the parameters whose gradients each rank computes
from its own heads, rows or share only (``replicate_grad_allreduce``, sliced projections, ``per_channel``
parameters stored whole, experts' parameters added once, routers inside experts modules (JetMoE's MLP),
parameters broadcast over split heads
(``Plan.partial_grads``: DiffLlama's lambdas), and under LoRA the adapter matrices beside a
split base, and under sequence parallelism the norms between the sub-blocks and the row-parallel biases);
``sum_tp_partial_grads`` sums them over TP once per step (the trainer calls it before
clipping). The sums inside a forward or backward are ``regions.py``'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardlm.parallel.model.adapters import ADAPTER, is_lora_layer
from shardlm.parallel.plan.channels import param_rows
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.sequence import scattered_biases, sequence_norms
from shardlm.parallel.plan.styles import Style


def tp_partial_grad_params(
    model: nn.Module, plan: Plan, with_lora: bool = False, sequence_parallel: bool = False
) -> list[str]:
    """FQNs of parameters whose gradients must be summed over TP (``replicate_grad_allreduce``,
    the replicated parameters of sliced projections and of ``per_channel`` modules following
    them, experts' parameters added ``once``, routers inside experts modules and ``Plan.partial_grads``;
    ``with_lora``: and the adapters';
    ``sequence_parallel``: and the norms and row-parallel biases computing on this rank's slice of the
    sequence)."""
    adapters = lora_partial_grads(model, plan) if with_lora else []
    adapters += sequence_norms(model, plan) + scattered_biases(model, plan) if sequence_parallel else []
    return (
        channel_partial_grads(model, plan)
        + [
            f"{fqn}.{pname}"
            for fqn, style in plan.styles.items()
            for pname, _ in model.get_submodule(fqn).named_parameters(recurse=False)
            if style == Style.REPLICATE_GRAD_ALLREDUCE
            or fqn in plan.sliced
            # an experts module's, or one under it (JetMoE's MoA bias, under the attention layer calling it)
            or (
                style in (Style.EXPERTS, Style.PER_CHANNEL)
                and getattr(plan.experts.get(fqn, {}).get(pname), "once", False)
            )
        ]
        + routers_inside_experts(model, plan)
        + plan.partial_grads
        + adapters
    )


def routers_inside_experts(model: nn.Module, plan: Plan) -> list[str]:
    """Parameters under an ``experts`` module outside its ``per_channel`` pieces: the router of a layer calling
    per-expert linears itself (JetMoE's MLP, ``infer/expert_layers.py``), whole on every rank inside the
    module whose output is a partial sum: each rank's gradient comes from its share of the experts only."""
    names = []
    for fqn, style in plan.styles.items():
        if style != Style.EXPERTS:
            continue
        for sub, module in model.get_submodule(fqn).named_modules(prefix=fqn):
            if sub != fqn and plan.styles.get(sub) != Style.PER_CHANNEL:
                names += [f"{sub}.{p}" for p, _ in module.named_parameters(recurse=False)]
    return names


@torch.no_grad()
def sum_tp_partial_grads(model: nn.Module, names: list[str], tp_group: dist.ProcessGroup) -> None:
    """All-reduce over TP the gradients that each rank computed from its own heads only: one
    all-reduce per dtype over the flattened gradients (they are small: norms, kv projections)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for name in names:
        grad = model.get_parameter(name).grad
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_dtype.setdefault(local.dtype, []).append(local)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def channel_partial_grads(model: nn.Module, plan: Plan) -> list[str]:
    """Parameters stored whole whose gradient each rank computes for its rows only: summed over TP."""
    return [
        f"{fqn}.{p}"
        for fqn, params in plan.channels.items()
        for p in params
        if param_rows(plan, fqn, p) is not None and p in dict(model.get_submodule(fqn).named_parameters(recurse=False))
    ]


def lora_partial_grads(model: nn.Module, plan: Plan) -> list[str]:
    """The replicated adapter matrices whose gradients each TP rank computes in part."""
    names = []
    for fqn, style in plan.styles.items():
        if is_lora_layer(model.get_submodule(fqn)):
            # the adapter matrix beside the base's whole side: it meets a partial activation or gradient
            partial = ("lora_B",) if style == Style.ROWWISE else ("lora_A",)
            sides = ("lora_A", "lora_B") if fqn in plan.sliced else partial
            names += [f"{fqn}.{side}.{ADAPTER}.weight" for side in sides]
    return names
