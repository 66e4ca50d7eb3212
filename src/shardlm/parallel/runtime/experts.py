"""The ``experts`` runtime style (``ExpertsParallel``): fused 3-D expert parameters, each expert's
intermediate dim sharded per ``Plan.experts`` (found by ``infer/experts.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardlm.distributed.shards import LocalParams, local_view
from shardlm.parallel.plan.styles import ExpertParam
from shardlm.parallel.runtime.linear import shard_params
from shardlm.parallel.runtime.regions import CopyToRegion, reduce_from_region


def expert_placements(module: nn.Module, params: dict[str, ExpertParam]) -> dict[str, object]:
    """The TP placement of each parameter of an experts module (``styles.ExpertParam``)."""
    whole = ExpertParam(None)
    return {name: params.get(name, whole).placement(p.shape) for name, p in module.named_parameters(recurse=False)}


class ExpertsParallel(ParallelStyle):
    """``experts``: a mixture-of-experts module of fused 3-D parameters, each expert's intermediate
    dim sharded (see the module docstring and ``parallel/infer/experts.py``); or one whose experts are
    stacked in a submodule (DBRX: that submodule ``per_channel``, its pieces read as local tensors here
    too, as the module views them before calling it; ``parallel/infer/expert_blocks.py``).

    While the module runs, its own parameters are local pieces (the hidden states and routing
    weights it reads are plain replicated tensors), so any experts kernel computes this rank's
    share of every expert: a partial sum of the output, all-reduced on the way out. A parameter
    placed ``once`` (a bias after the down projection) is whole on every rank but used by rank 0
    only (others see zeros): its gradient is summed over TP with the other TP-partial gradients
    (``tp_partial_grad_params``). The gradients of the floating-point inputs are summed over TP
    in one all-reduce (``CopyToRegion``): each rank's covers only its share of the experts.
    The swap is ``LocalParams``'s.
    """

    def __init__(self, params: dict[str, ExpertParam]):
        super().__init__()
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_params(module, device_mesh, expert_placements(module, self.params), self.src_data_rank)
        muted = device_mesh.get_local_rank() != 0
        once = {name for name, p in self.params.items() if p.once}
        params = LocalParams()

        def to_local(mod, args, kwargs):
            for path, sub in mod.named_modules():  # DBRX's experts read their submodule's stacked pieces
                for name, param in list(sub._parameters.items()):
                    if isinstance(param, DTensor):
                        local = local_view(param)
                        muting = muted and f"{path}.{name}".lstrip(".") in once  # JetMoE's MoA bias: "experts.bias"
                        params.swap(sub, name, local * 0 if muting else local)
            flat, spec = tree_flatten((args, kwargs))
            floats = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if floats:
                summed = CopyToRegion.apply(device_mesh, *(flat[i] for i in floats))
                for i, t in zip(floats, summed):
                    flat[i] = t
            return tree_unflatten(flat, spec)

        def restore(mod, args, out):
            params.restore()
            if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
                # an attention layer calling a routed layer (JetMoE's): its output first, its router's logits
                # (whole on every rank) and attention weights (its heads) after it
                return (reduce_from_region(out[0], device_mesh), *out[1:])
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"{type(mod).__name__} returned {type(out).__name__}, not one tensor")
            return reduce_from_region(out, device_mesh)  # a tensor of its own: models add into it in place

        module.register_forward_pre_hook(to_local, with_kwargs=True)
        module.register_forward_hook(restore)
        return module
