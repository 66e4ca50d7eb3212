"""The ``per_channel`` runtime style (``PerChannel``): parameters acting per channel or per head on split
activations, placed like the channels they meet; while the module runs it sees local views of them
(the plan side: ``infer/channels.py``, ``plan/channels.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from shardlm.distributed.shards import LocalParams, local_view, parameter
from shardlm.parallel.plan.rows import lead_dim
from shardlm.parallel.plan.styles import ExpertParam


def _rows(t: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in rows]) if len(rows) > 1 else t[rows[0][0] : rows[0][1]]


class PerChannel(ParallelStyle):
    """``per_channel`` (see the module docstring): own parameters placed per ``params``
    (``ExpertParam``: dim 0 split ``parts`` ways, or whole), others replicated; while the module
    runs, it and the ``per_channel`` modules under it (``views``: ``local_views``) see local views:
    the local shards, or their rank's rows of the whole-stored ones (swapped by ``LocalParams``)."""

    def __init__(self, params: dict[str, ExpertParam], views: dict[str, dict[str, list[list[tuple[int, int]]]]]):
        super().__init__()
        self.params = params
        self.views = views

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            placement = self.params.get(name, ExpertParam(None)).placement(param.shape)
            module.register_parameter(name, parameter(param, device_mesh, placement, self.src_data_rank))
        rank = device_mesh.get_local_rank()
        views = {path: {p: rows[rank] for p, rows in params.items()} for path, params in self.views.items()}
        params, buffers = LocalParams(), []

        def to_local(mod, args):
            for path, rows in views.items():
                sub = mod.get_submodule(path)
                for name, param in list(sub._parameters.items()):
                    if isinstance(param, DTensor):
                        local = local_view(param)
                        params.swap(sub, name, _rows(local, rows[name]) if name in rows else local)
                for name, buffer in list(sub._buffers.items()):
                    if name in rows:  # Falcon-H1's mup_vector: its rows along its channel dim
                        buffers.append((sub, name, buffer))
                        dim = lead_dim(buffer)
                        sub._buffers[name] = torch.cat([buffer.narrow(dim, a, b - a) for a, b in rows[name]], dim)

        def restore(mod, args, out):
            params.restore()
            while buffers:
                sub, name, buffer = buffers.pop()
                sub._buffers[name] = buffer

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore)
        return module
