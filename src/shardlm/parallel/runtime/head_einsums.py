"""Sums over TP around the einsums of a split per-head-einsum attention (``Plan.head_einsums``,
``infer/head_einsums.py``: XLNet's relative attention).

Each rank holds its heads of the per-head parameters (``per_channel``: local views while the module
runs). While the module runs, a torch-function mode catches the einsums reading them:

* ``reads_whole`` (q, k, v, r projecting the residual stream and the positions, like column-parallel
  linears): the other operands enter the region (``copy_to_region``): their gradients, each rank's from
  its heads only, are summed over TP on the way back. Only those reads: the same input also added as
  the residual (``post_attention``'s ``attn_out + h``) carries its whole gradient on every rank already.
* ``sums_heads`` (o, the output projection summing the heads): the ranks' partial outputs are summed
  (``reduce_from_region``) right there, before the dropout and the residual the model's method applies
  next (no module boundary where a row-parallel style could).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.runtime.modes import while_running
from shardlm.parallel.runtime.regions import copy_to_region, reduce_from_region


class _HeadEinsums(TorchFunctionMode):
    """Einsums of ``module``'s per-head parameters (``roles``: name -> ``reads_whole`` or ``sums_heads``)
    with their sums over TP (see the module docstring)."""

    def __init__(self, module: nn.Module, roles: dict[str, str], mesh: DeviceMesh):
        super().__init__()
        self.module, self.roles, self.mesh = module, roles, mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.einsum or len(args) < 2:
            return func(*args, **kwargs)
        listed = len(args) == 2 and isinstance(args[1], (list, tuple))
        operands = list(args[1] if listed else args[1:])
        role = next((r for n, r in self.roles.items() if any(t is self.module._parameters[n] for t in operands)), None)
        if role == "reads_whole":
            params = {id(self.module._parameters[n]) for n in self.roles}
            operands = [t if id(t) in params else copy_to_region(t, self.mesh) for t in operands]
        out = func(args[0], *operands, **kwargs)
        return reduce_from_region(out, self.mesh) if role == "sums_heads" else out


def sum_head_einsums(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Hooks on each module of ``plan.head_einsums``: its einsums run under ``_HeadEinsums`` while it runs
    (registered after its ``per_channel`` style's: the parameters it sees are its local views)."""
    for fqn, roles in plan.head_einsums.items():
        module = model.get_submodule(fqn)
        mode = _HeadEinsums(module, roles, mesh)
        while_running(module, mode)
