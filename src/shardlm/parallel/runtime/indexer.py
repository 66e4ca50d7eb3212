"""The split DSA indexer's top-k on the sum of every rank's scores (``Plan.indexers``, ``infer/indexer.py``).

Each rank's indexer holds its query heads (``n_heads`` local) and computes
``local_heads ** -0.5 * sum over its heads``; the top-k it ends with must see the sum over all heads,
scaled by ``n_heads ** -0.5`` as one process scales it. While the indexer runs, a torch-function mode
catches that ``topk``: its input is all-reduced over TP (forward only: the indexer runs under
``no_grad``) and rescaled by ``(local_heads / n_heads) ** 0.5`` before the top-k runs. The causal mask
the indexer added on each rank adds up too: 0 stays 0, a masked position (``finfo.min`` or ``-inf``) goes
to ``-inf``, below every unmasked score as in one process (the attention masks those positions anyway).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.runtime.modes import while_running
from shardlm.parallel.runtime.regions import all_reduce


class _SummedTopk(TorchFunctionMode):
    """``topk`` on the sum over TP of each rank's scores, rescaled to the whole head count."""

    def __init__(self, mesh: DeviceMesh, scale: float):
        super().__init__()
        self.mesh, self.scale = mesh, scale

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            args = (all_reduce(args[0].contiguous(), self.mesh) * self.scale, *args[1:])
        return func(*args, **kwargs)


def sum_indexer_scores(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Hooks on each indexer of ``plan.indexers``: its top-k reads the scores summed over TP while it runs."""
    for fqn, heads in plan.indexers.items():
        module = model.get_submodule(fqn)
        mode = _SummedTopk(mesh, (module.n_heads / heads) ** 0.5)  # n_heads: local (``localize_geometry``)
        while_running(module, mode)
