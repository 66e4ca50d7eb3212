"""A split indexer's top-k on the sum of every rank's scores (``Plan.indexers``, ``infer/indexer.py``).

Each rank's indexer holds its query heads (DSA's ``n_heads``, QSA's ``index_n_heads``: local) and computes its
scores summed over its heads; the top-k it ends with must see the sum over all heads, as one process computes
it. While the indexer runs, a torch-function mode catches that ``topk``: its input is all-reduced over TP
(forward only: no gradient reaches an indexer) and multiplied by the plan's factor before the top-k runs (DSA
scales its sum by ``heads ** -0.5``: each rank by its local count, so the sum is rescaled by ``tp ** -0.5``;
QSA's sum is plain, factor 1). The causal mask DSA's indexer added on each rank adds up too: 0 stays 0, a
masked position (``finfo.min`` or ``-inf``) goes to ``-inf``, below every unmasked score as in one process
(the attention masks those positions anyway). QSA's top-k runs once per query over its visible blocks, the
same count on every rank.
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
    """``topk`` on the sum over TP of each rank's scores, times the plan's factor."""

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
    for fqn, factor in plan.indexers.items():
        while_running(model.get_submodule(fqn), _SummedTopk(mesh, factor))
