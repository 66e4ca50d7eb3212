"""Replicated styles: ``replicate`` (``ReplicateParallel``: parameters DTensors on the TP mesh, activations
plain), ``replicate_local`` / ``replicate_own`` (``LocalReplicate``: local views of replicated
parameters) and ``sharded_norm`` (``ShardedRMSNorm``: an RMSNorm over a sharded width); the local views of
whole parameters another module's forward reads directly (``serve_direct_reads``, ``Plan.direct_reads``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from shardlm.distributed.shards import LocalParams, local_view
from shardlm.parallel.model.hf import rms_norm_eps, weightless_norm
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.runtime.linear import shard_params


class ReplicateParallel(ParallelStyle):
    """Parameters replicated on the TP mesh; inputs enter as replicated DTensors, outputs leave local."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        shard_params(
            module, mesh, {n: Replicate() for n, _ in module.named_parameters(recurse=False)}, self.src_data_rank
        )

    @staticmethod
    def _wrap(x, mesh: DeviceMesh):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x

    @staticmethod
    def _unwrap_outputs(module: nn.Module, outputs, mesh: DeviceMesh):
        if isinstance(outputs, DTensor) and isinstance(module, nn.Embedding):
            return outputs.to_local().clone()  # learned positions are added to in place (XLM)
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # inputs may come as keyword arguments (OPT's positions): wrap those too
        def wrap_inputs(mod, args, kwargs):
            args = tuple(self._wrap(a, device_mesh) for a in args)
            return args, {k: self._wrap(v, device_mesh) for k, v in kwargs.items()}

        distribute_module(module, device_mesh, self._partition, None, self._unwrap_outputs)
        module.register_forward_pre_hook(wrap_inputs, with_kwargs=True)
        return module


class LocalReplicate(ParallelStyle):
    """``replicate_local``: parameters replicated on the TP mesh (DTensors, like ``replicate``), but
    while the module runs, it and its submodules see local views of them, so code that uses a
    child's parameter directly (``conv1d(x, self.conv1d.weight)``) or makes plain tensors of its
    own computes on plain tensors throughout. Every rank computes the same values; the views'
    gradients arrive as replicated gradients of the parameters (swapped by ``LocalParams``)."""

    def __init__(self, own_only: bool = False):
        super().__init__()
        self.own_only = own_only  # ``replicate_own``: split children place their own parameters

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_params(
            module, device_mesh, {n: Replicate() for n, _ in module.named_parameters(recurse=False)}, self.src_data_rank
        )
        _local_views_while_running(module, lambda: [module] if self.own_only else module.modules())
        return module


def _local_views_while_running(module: nn.Module, holders) -> None:
    """Hooks on ``module``: while its forward runs, the DTensor parameters of the modules ``holders()``
    returns are local views (swapped by ``LocalParams``, put back after it), their gradients arriving as the
    parameters' replicated ones."""
    params = LocalParams()

    def to_local(mod, args):
        for sub in holders():
            for name, param in list(sub._parameters.items()):
                if isinstance(param, DTensor):
                    params.swap(sub, name, local_view(param))

    module.register_forward_pre_hook(to_local)
    module.register_forward_hook(lambda mod, args, out: params.restore())


def serve_direct_reads(model: nn.Module, plan: Plan) -> None:
    """Hooks on each module of ``plan.direct_reads``: while its forward runs, the whole (``Replicate``)
    parameters of the owners it reads directly are local views, as a ``replicate_local`` module sees its
    own (``parallel/infer/direct_reads.py``): Gemma 3n's decoder layer clamping and multiplying AltUp's
    coefficients. An owner's own forward run inside (AltUp's ``prediction_coefs``) finds them plain
    already; the views' gradients arrive as the parameters' replicated ones."""
    users: dict[str, list[nn.Module]] = {}
    for owner, (user, _) in plan.direct_reads.items():
        users.setdefault(user, []).append(model.get_submodule(owner))
    for user, owners in users.items():
        _local_views_while_running(model.get_submodule(user), lambda owners=owners: owners)


class ShardedRMSNorm(ParallelStyle):
    """RMSNorm across a sharded width (OLMo-2's q_norm/k_norm after column-parallel q/k): the
    weight is sharded like the activation; each rank sums the squares of its slice and one
    all-reduce of that ``[tokens, 1]`` sum gives the full width's mean (in the backward, the
    gradients of the sum are all-reduced the same way). No activation is gathered. The formula
    is checked against the module's own forward when the plan is made (``hf.rms_norm_eps``). A
    parameter-free norm (Dory's L2 norm ``x / sqrt(sum(x^2) + eps)``, ``hf.weightless_norm``) is the
    same without a weight, over the sum or the mean of the squares."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weighted = getattr(module, "weight", None) is not None
        eps, mean = (rms_norm_eps(module), True) if weighted else weightless_norm(module)
        width = module.weight.shape[0] if weighted else None  # else the whole width: tp equal slices
        if weighted:
            shard_params(module, device_mesh, {"weight": Shard(0)}, self.src_data_rank)

        def forward(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
            h = x.float()
            if gate is not None:  # Mamba-2's gated norm: gated first (``hf.gates_before_norm``)
                h = h * F.silu(gate.float())
            squares = DTensor.from_local(h.pow(2).sum(-1, keepdim=True), device_mesh, [Partial()], run_check=False)
            total = squares.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            if mean:
                total = total / (width or h.shape[-1] * device_mesh.size())
            normed = h * torch.rsqrt(total + eps)
            return (local_view(module.weight) * normed if weighted else normed).to(x.dtype)

        module.forward = forward
        return module
