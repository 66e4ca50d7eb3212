"""The ``shardlm plan`` table: one row per styled module of an inferred plan, and why it is so.

Per module: its style, global and per-rank parameter shapes and fp32 bytes (rank 0's, the largest, where a
vocabulary tp does not divide is split in torch's chunks: the rows of each rank are named), and where the decision
came from (the trace, cross-checked against the model's own ``base_model_tp_plan``; tied, kept
replicated with its sub-block, experts, channels followed, rows sliced or stored by rank, latents, summed outputs),
so a user can read what each rank will hold before training (``cli.py``).
"""

from __future__ import annotations

import torch.nn as nn

from shardlm.parallel.plan.channels import param_rows
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.rows import chunk_rows
from shardlm.parallel.plan.styles import ExpertParam, local_shape, sharded_dim


def describe_plan(model: nn.Module, plan: Plan, tp: int) -> list[dict]:
    """One row per styled module: style, global and local parameter shapes, fp32 bytes per
    rank, and where the decision came from (cross-checked against the model's own plan or not)."""
    rows, seen = [], {}
    latents = set(plan.latent_readers.values())
    for fqn, style in plan.styles.items():
        module = model.get_submodule(fqn)
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        tied = [seen[id(p)] for _, p in module.named_parameters(recurse=False) if id(p) in seen]
        seen.update({id(p): f"{fqn}.{n}" for n, p in params})
        dims = {n: sharded_dim(style, module, n, plan.experts.get(fqn)) for n, _ in params}
        local = {n: local_shape(tuple(p.shape), dims[n], tp) for n, p in params}
        source = f"inferred, tied to {tied[0]}" if tied else "inferred"
        source += _uneven(params, dims, tp)
        if fqn in plan.agrees_with_hf:
            source = "inferred, agrees with HF plan" if plan.agrees_with_hf[fqn] else "inferred, DIFFERS from HF plan"
        if fqn in plan.replicated:
            source += "; its sub-block is kept replicated (listed below)"
        if fqn in plan.head_einsums:  # XLNet's attention (``infer/head_einsums.py``)
            roles = ", ".join(f"{n} {r}" for n, r in plan.head_einsums[fqn].items())
            source += f"; per-head parameters split by heads, their einsums: {roles}"
        elif fqn in plan.experts and (style == "experts" or (style == "per_channel" and fqn not in plan.channels)):
            source += f"; {describe_experts(plan.experts[fqn])}"  # MoE (a per_channel one: DBRX's stacked experts)
        if set(plan.channels.get(fqn, {}).values()) == {fqn}:  # ``summed.place_direct``: its own rows
            source += "; column-parallel, its weight multiplied directly by its parent (split by rows, local views)"
        for pname, linear in plan.channels.get(fqn, {}).items():
            if linear == fqn:
                continue
            whole = " (stored whole, each rank uses its rows)" if param_rows(plan, fqn, pname) is not None else ""
            linears = " + ".join(n.rpartition(".")[2] for n in linear.split(" + "))  # OLMo-hybrid's q + k + v
            source += f"; {pname} split with the output channels of {linears}{whole}"
        if fqn in plan.sliced:
            local = {n: tuple(p.shape) for n, p in params}  # stored whole on every TP rank
            used = sorted({sum(b - a for a, b in rows) for rows in plan.sliced[fqn]})  # Zaya's value: its heads'
            if fqn in latents:
                source += "; a low-rank latent (MLA): stored replicated, computed whole, grads summed over TP"
            else:
                used = used[0] if len(used) == 1 else " or ".join(map(str, used))
                source += f"; stored replicated, each rank computes {used} of its rows, grads summed over TP"
        if fqn in plan.stored_rows:  # Zaya's value projections: rank 0's rows shown, as rank 0's chunk elsewhere
            held = plan.stored_rows[fqn]
            local = {n: (sum(b - a for a, b in held[0]), *p.shape[1:]) for n, p in params}
            ranks = ", ".join(" ".join(f"{a}:{b}" for a, b in rows if b > a) or "none" for rows in held)
            source += f"; stored by the rows each rank computes (its heads'): {ranks} (rank 0's shown)"
        if fqn in plan.latent_readers:
            source += f"; reads the latent of {plan.latent_readers[fqn].rpartition('.')[2]}, whose input sums its grads"
        if fqn in plan.summed:
            source += "; its output, read back inside the split channels, has its gradient summed over TP"
        rows.append(
            {
                "module": fqn,
                "style": style,
                "global": {n: tuple(p.shape) for n, p in params},
                "local": local,
                "bytes_per_rank": sum(4 * _numel(s) for s in local.values()),
                "bytes_global": sum(4 * p.numel() for _, p in params),
                "source": source,
            }
        )
    return rows


def _uneven(params: list[tuple[str, nn.Parameter]], dims: dict[str, int | None], tp: int) -> str:
    """``; rows 127 | 126 per rank (weight: 253 in torch's chunks)``: a split dim tp does not divide (the
    vocabulary), whose local shape and bytes are rank 0's, the largest."""
    notes = []
    for name, p in params:
        dim = dims[name]
        if dim is not None and dim < p.ndim and p.shape[dim] % tp:
            rows = " | ".join(map(str, chunk_rows(p.shape[dim], tp)))
            notes.append(f"; rows {rows} per rank ({name}: {p.shape[dim]} in torch's chunks, rank 0's shown)")
    return "".join(notes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def describe_experts(layout: dict[str, ExpertParam]) -> str:
    """``gate_up_proj dim 1 in 2 parts, down_proj dim 2, down_proj_bias added once`` (``shardlm plan``)."""
    words = []
    for name, p in layout.items():
        if p.dim is not None:
            words.append(f"{name} dim {p.dim}" + (f" in {p.parts} parts" if p.parts > 1 else ""))
        else:
            words.append(f"{name} {'whole, added by one rank' if p.once else 'whole'}")
    return "probed: " + (", ".join(words) or "its experts stacked in the module under it, split there")
