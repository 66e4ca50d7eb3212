"""The plan's answers about ``per_channel`` parameters (``infer/channels.py`` places them): every rank's
rows of one stored whole (``param_rows``) and the local views a ``per_channel`` module runs with
(``local_views``), the dim each is split along (``channel_dim``), read by the runtime style, the dry run, the
plan table and the estimate.
"""

from __future__ import annotations

import torch

from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.rows import lead_dim


def param_rows(plan: Plan, fqn: str, pname: str) -> list[list[tuple[int, int]]] | None:
    """Every rank's rows of ``per_channel`` parameter (or buffer) ``fqn.pname`` where it is stored
    whole (some of its channels shared by ranks, or a buffer), else None."""
    key = f"{fqn}.{pname}"
    if key in plan.channel_rows or key in plan.channel_parts:
        return plan.channel_rows.get(key)
    return plan.sliced.get(plan.channels[fqn][pname])


def channel_dim(plan: Plan, fqn: str, pname: str, param: torch.Tensor) -> int:
    """The dim of ``per_channel`` parameter ``fqn.pname`` (``param``) along the channels it meets: its first
    longer than 1, or the one the trace found (``Plan.channel_dims``: Inkling 2's taps [kernel, channels])."""
    return plan.channel_dims.get(f"{fqn}.{pname}", lead_dim(param))


def local_views(plan: Plan, fqn: str) -> dict[str, dict[str, list[list[tuple[int, int]]]]]:
    """For ``per_channel`` module ``fqn``: the ``per_channel`` modules it runs (itself: "", and
    those under it, by path relative to it), each with, per whole-stored parameter, every rank's rows."""
    views = {"": {}} if fqn in plan.head_einsums else {}  # XLNet's attention: its own per-head parameters
    for name, params in plan.channels.items():
        if name == fqn or name.startswith(f"{fqn}."):
            path = name[len(fqn) + 1 :]
            found = {p: param_rows(plan, name, p) for p in params}
            views[path] = {p: r for p, r in found.items() if r is not None}
    return views
