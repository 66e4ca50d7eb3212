"""What one trace found (``Traced``), collected after the forward from the hooks and the tracker
(``collect``): directions of the linears, packed parts from how their outputs are cut, the parameters
following split channels with their parts, the int attributes read, latents, summed outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from shardlm.parallel.infer.broadcast import broadcast_violations
from shardlm.parallel.infer.head_inputs import partial_grads as head_partial_grads
from shardlm.parallel.infer.latent import latent_candidates
from shardlm.parallel.infer.parts import parts_from_consumer, refined
from shardlm.parallel.infer.trace_hooks import TraceHooks
from shardlm.parallel.infer.tracker import ShardTracker
from shardlm.parallel.infer.wholes import whole_flags


@dataclass
class Traced:
    styles: dict[str, str]
    parts: dict[str, list[int]]
    violations: list[tuple[frozenset[str], str]]
    closer_inputs: dict[str, frozenset[str]]  # rowwise linear -> sources of what it reads
    views: dict[str, tuple[int, ...]]  # colwise linear -> shape of the first view of its output
    foreign: dict[str, str]  # owner of a parameter -> another module whose forward used it directly
    dropout_sites: list[tuple[bool, tuple[int, ...], float, int | None]]  # see ``ShardTracker.dropout_sites``
    # parameter fqn -> (the column-parallel linears whose channels it acts on, their layout's parts or None)
    follows: dict[str, tuple[frozenset[str], tuple[int, ...] | None]]
    reads: dict[str, set[str]]  # module holding linears -> int attributes of its own its forward read
    split_sizes: dict[str, set[int]]  # see ``ShardTracker.split_sizes``
    int_uses: dict[str, dict[str, set[str]]]  # module -> int attribute -> what it sized (``sizes.py``)
    # stretches of linears' outputs found summed over their split channels, not yet held whole (traced
    # again with them in ``wholes``); and per packed linear or following parameter, which parts are whole
    new_wholes: set[tuple[str, int, int]]
    whole: dict[str, list[bool]]
    # column-parallel linear -> the row-parallel linear reading it whose output is then viewed into
    # heads (MLA's q_a_proj -> q_b_proj): a low-rank latent, better kept whole (``latent_candidates``)
    latents: dict[str, str]
    # with ``trace_model(latents=...)``: module reading a latent's tensors -> those latents, and
    # latent -> why its gradient cannot stay partial (``ShardTracker.latent_leaks``)
    latent_readers: dict[str, set[str]]
    latent_leaks: dict[str, str]
    # ``summed.py``: linears multiplied directly by their parent; row-parallel linears whose whole output is
    # read inside the split region (its gradient summed over TP); module with parameters reading it -> those
    direct: set[str]
    summed: set[str]
    summed_readers: dict[str, set[str]]
    # module -> {its argument (position or name): the heads dim} handed per head (``head_inputs.py``)
    head_inputs: dict[str, dict[int | str, int]]
    # parameters broadcast over split activations, replicated, gradients summed over TP (``broadcast.py``)
    partial_grads: list[str]
    # module -> owner of the tied embedding whose rows it reads by index (``ShardTracker.row_reads``)
    row_reads: dict[str, str]
    # row-parallel linears whose output, one value per head, could be narrowed to each rank's heads, and those
    # this trace narrowed (``narrowed.py``)
    narrow: set[str]
    narrowed: frozenset[str]
    # column-parallel linears whose split output meets a whole activation of its shape -> why (``checks.py``)
    misfits: dict[str, str]
    ran: frozenset[str] = frozenset()  # modules whose forward ran (``unrun``)
    # linears' whole outputs concatenated, then viewed into heads of so many channels (``layouts.Cuts``)
    head_views: frozenset[tuple[tuple[tuple[str, int], ...], int]] = frozenset()
    # following parameter fqn -> its dim along the channels, where not its first longer than 1 (``follow.py``)
    follow_dims: dict[str, int] | None = None
    # module -> {per-head parameter: its role in the einsums reading it} (``head_einsums.py``: XLNet's attention)
    head_einsums: dict[str, dict[str, str]] = field(default_factory=dict)


def collect(
    meta: nn.Module,
    tracker: ShardTracker,
    hooks: TraceHooks,
    reads: dict[str, set[str]],
    wholes: frozenset[tuple[str, int, int]],
) -> Traced:
    """The ``Traced`` of a finished forward of ``meta``; ``reads``: int attributes each module holding
    linears read (``sizes.watch_reads``); ``wholes``: the stretches the trace held whole."""
    styles, outputs, closer_inputs = hooks.styles, hooks.outputs, hooks.closer_inputs
    int_reads = {
        name: {a for a in names if type(meta.get_submodule(name).__dict__.get(a)) is int}
        for name, names in reads.items()
    }
    direct = tracker.direct - styles.keys()  # multiplied directly by its parent, its forward never run
    for fqn in direct:  # (``summed.py``)
        styles[fqn] = "colwise"
    for fqn in sorted(tracker.rows_met & tracker.rows_leaks.keys()):
        tracker.violations.append(
            (
                closer_inputs.get(fqn, frozenset()),
                f"the output of {fqn}, whole, meets its split activations and {tracker.rows_leaks[fqn]}",
            )
        )
    summed = tracker.rows_met - tracker.rows_leaks.keys()
    parts, views = {}, {}
    for name, style in styles.items():
        if style == "colwise" and name in outputs:
            views[name] = tracker.first_view.get(id(outputs[name]), ())[outputs[name].dim() :]
            found = parts_from_consumer(tracker, outputs[name]) or tracker.later_parts.get(name)
            found = refined(found or [outputs[name].shape[-1]], tracker.cuts.parts(name, 0, outputs[name].shape[-1]))
            if found and len(found) > 1:
                styles[name], parts[name] = "packed_colwise", found
    names = {
        id(p): f"{m_name}.{p_name}" if m_name else p_name
        for m_name, m in meta.named_modules()
        for p_name, p in m.named_parameters(recurse=False)
    }
    # before the violations are handed on; CPM-Ant's position bias table too (``head_inputs.py``)
    partial_grads = broadcast_violations(tracker, names) + head_partial_grads(tracker, names)
    follows = {names[pid]: source for pid, source in tracker.follows.items()} | tracker.buffer_follows
    whole = {name: whole_flags(wholes, name, 0, p) for name, p in parts.items()}
    for pid, (linear, start) in tracker.follow_origins.items():  # a stretch of a linear cut again later
        sources, (width,) = tracker.follows[pid]
        follows[names[pid]] = (sources, tracker.cuts.parts(linear, start, width))
        whole[names[pid]] = whole_flags(wholes, linear, start, follows[names[pid]][1])
    return Traced(
        styles,
        parts,
        tracker.violations,
        closer_inputs,
        views,
        tracker.foreign,
        tracker.dropout_sites,
        follows,
        {name: names for name, names in int_reads.items() if names},
        tracker.split_sizes,
        tracker.int_uses,
        tracker.found_wholes - wholes,
        {name: flags for name, flags in whole.items() if any(flags)},
        latent_candidates(tracker, styles, outputs, closer_inputs, meta),
        {name: set(fqns) for name, fqns in tracker.latent_readers.items()},
        dict(tracker.latent_leaks),
        direct,
        summed,
        {name: set(fqns & summed) for name, fqns in tracker.rows_readers.items() if fqns & summed},
        tracker.found_head_inputs,
        partial_grads,
        tracker.row_reads,
        tracker.narrow,
        tracker.narrowed,
        dict(tracker.misfits),
        frozenset(hooks.ran),
        frozenset(tracker.cuts.head_views),
        {names[pid]: dim for pid, dim in tracker.follow_dims.items()},
        {m: dict(roles) for m, roles in tracker.head_einsums.items()},
    )
