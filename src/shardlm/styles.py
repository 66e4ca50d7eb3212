"""Style names -> DTensor ``ParallelStyle`` objects.

Every style is torch's own except ``replicate``, which torch lacks for the case without
sequence parallelism: a module (an RMSNorm) whose parameters must be DTensors on the TP mesh
while the activations flowing through it are plain tensors. It wraps its inputs as replicated
DTensors and hands plain tensors back, so the module's math runs unchanged and its gradients
are replicated DTensors that FSDP2 and clipping treat like every other parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


class ReplicateParallel(ParallelStyle):
    """Parameters replicated on the TP mesh; inputs enter as replicated DTensors, outputs leave local."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            dist = distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    @staticmethod
    def _wrap_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    @staticmethod
    def _unwrap_outputs(module: nn.Module, outputs, mesh: DeviceMesh):
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._wrap_inputs, self._unwrap_outputs)


def make_style(style: str) -> ParallelStyle:
    """The torch style for one word of the plan vocabulary (see ``plan.STYLES``)."""
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "embedding":
        # vocab rows sharded; each rank looks up its rows, the partial sums are all-reduced
        return RowwiseParallel(input_layouts=Replicate())
    if style == "lm_head":
        # logits stay sharded over the vocabulary: the loss runs under loss_parallel
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if style == "replicate":
        return ReplicateParallel()
    raise ValueError(f"unknown TP style '{style}'")
