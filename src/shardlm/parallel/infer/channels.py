"""Parameters acting per channel or per head on split activations, split with them (``per_channel``).

Linear-attention and state-space mixers keep state per head between an in-projection and an
out-projection: Qwen3.5's Gated DeltaNet convolves the output of its fused q/k/v projection with
a depthwise ``conv1d`` (one filter per channel) before cutting it into heads, and scales its
per-head decay by ``A_log`` and ``dt_bias``. The trace (``follow.follows``) finds such a
parameter from the dataflow: its first dim meets the split dim of split activations at its full
size (a depthwise convolution over them, or an elementwise op broadcasting it along them). Each
rank then holds the channels of its own heads, exactly the rows of the activations it holds:

* where they are one projection's whole output: after a ``colwise`` projection, ``Shard(0)``;
  after a ``packed_colwise`` one, its chunk of every part (``shards.packed_placement``: DeltaNet's
  [key, key, value]), so checkpoints keep the HF layout;
* where they were reshaped, cut or concatenated on the way (``layouts.py``: LFM's conv over the x
  third of ``in_proj``, Qwen3-Next's over q|k|v cut per key head out of ``in_proj_qkvz``,
  OLMo-hybrid's over cat(q_proj, k_proj, v_proj)), the same by the parts of their channel layout
  (``Plan.channel_parts``);
* where some of those rows are shared by ranks (their source is ``Plan.sliced``: fewer kv heads
  than tp, or Mamba-2's B and C held whole at ``n_groups < tp``): stored whole on every rank, each
  using its rows (``Plan.channel_rows`` or the source's), the gradients summed over TP (each
  rank's covers its rows only). A buffer (Falcon-H1's ``mup_vector``) is never sharded: each rank
  uses its rows.

The ``per_channel`` style goes to every module owning such parameters and to a module that uses
them directly (the mixer calling ``causal_conv1d_fn(x, self.conv1d.weight)``: the conv module's
own forward never runs). While it runs, it and the modules under it see local views of these
parameters (their rows), whatever kernel the mixer calls (torch's fallback or a fused one): the
trace and the plan do not depend on it. The sizes the mixer's forward reads off itself
(``self.key_dim`` in its ``split``, Qwen3-Next's ``num_k_heads`` in its ``view``) are set to
their local values (``local_sizes``).
"""

from __future__ import annotations

import torch.nn as nn

from shardlm.errors import ConfigError
from shardlm.parallel.model.hf import all_head_widths, out_features, weight_kernel, weight_kernels_available
from shardlm.parallel.plan.channels import channel_dim, param_rows
from shardlm.parallel.plan.local_geometry import WIDTH_ATTRS
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.rows import local_width, rank_rows
from shardlm.parallel.plan.styles import ExpertParam, Style


def place_channels(
    model: nn.Module,
    plan: Plan,
    follows: dict[str, tuple[frozenset[str], tuple[int, ...] | None]],
    foreign: dict[str, str],
    tp: int,
    dims: dict[str, int] | None = None,
) -> None:
    """Give the ``per_channel`` style to the owners of the parameters in ``follows`` (parameter
    fqn -> the linears whose channels it acts on and the parts of their layout, from the trace)
    and to the modules using them directly (``foreign``: owner -> user), recording each
    parameter's source in ``plan.channels`` and, where it is not one linear's whole output, its
    parts in ``plan.channel_parts``; ``dims``: a parameter's dim along the channels, where not its first
    (``plan.channel_dims``)."""
    for pfqn, (sources, layout) in sorted(follows.items()):
        owner, _, pname = pfqn.rpartition(".")
        if any(
            plan.styles.get(s) not in (Style.COLWISE, Style.PACKED_COLWISE) and s not in plan.narrowed for s in sources
        ):
            continue  # its sources stay whole (a kept-replicated sub-block): so does it
        if any(s in plan.sliced and layout is not None and not _chunked(plan, s, tp) for s in sources):
            continue  # rows picked per rank (fewer kv heads than tp) under a reshaped layout: kept whole
        (source, *_) = sorted(sources)
        if pfqn in (dims or {}) and (any(plan.whole_parts.get(pfqn, [])) or source in plan.sliced):
            continue  # rows shared by ranks along a later dim: kept whole (its module then fails the dry run)
        width = out_features(model.get_submodule(source))
        parts = list(layout) if layout is not None else plan.parts.get(source, [width])
        whole = plan.whole_parts.get(pfqn, [False] * len(parts))  # held whole on every rank (Mamba-2's B, C)
        if any(p % tp for p, held in zip(parts, whole) if not held):
            raise ConfigError(
                f"parallel.tp={tp} does not divide the channels {parts if len(parts) > 1 else parts[0]} of "
                f"{', '.join(sorted(sources))}, which {pfqn} acts on; choose a tp that divides them"
            )
        plan.styles[owner] = Style.PER_CHANNEL.value
        _local_groups(model.get_submodule(owner), owner, plan, parts, tp)
        plan.channels.setdefault(owner, {})[pname] = " + ".join(sorted(sources))
        if layout is not None:
            plan.channel_parts[pfqn] = list(layout)
        if pfqn in (dims or {}):
            plan.channel_dims[pfqn] = dims[pfqn]
        buffer = pname in dict(model.get_submodule(owner).named_buffers(recurse=False))
        if any(whole) or (buffer and source not in plan.sliced):  # else the source's rows (``param_rows``)
            plan.channel_rows[pfqn] = [rank_rows(parts, r, tp, whole) for r in range(tp)]
    for owner, user in foreign.items():
        if owner.split(" (")[0] in plan.channels and plan.styles.get(user) in (
            None,
            Style.REPLICATE,
            Style.PER_CHANNEL,
        ):
            plan.styles[user] = Style.PER_CHANNEL.value
            plan.channels.setdefault(user, {})


def _local_groups(module: nn.Module, fqn: str, plan: Plan, parts: list[int], tp: int) -> None:
    """A grouped convolution split with its channels (Zaya's ``conv_qk_grouped``, one group per head of
    cat(q, k); a depthwise one, one group per channel) runs ``groups // tp`` groups on each rank: its
    ``groups`` is a local size. Each rank's chunk of every part of its channels must be whole groups."""
    groups = getattr(module, "groups", 1)
    if not isinstance(module, nn.modules.conv._ConvNd) or groups == 1:
        return
    per = module.out_channels // groups
    if any((p // tp) % per for p in parts):
        raise ConfigError(
            f"parallel.tp={tp} splits the channels {parts} of {fqn} inside its groups of {per}; "
            "choose a tp that divides its heads"
        )
    plan.local_sizes.setdefault(fqn, {})["groups"] = groups // tp


def check_fused_kernels(model: nn.Module, plan: Plan, tp: int) -> None:
    """Refuse a split mixer whose forward would call a fused kernel reading its projections' weights
    itself (``hf.WEIGHT_KERNELS``: Mamba's ``mamba_inner_fn``, Mamba-2's
    ``mamba_split_conv1d_scan_combined``), where transformers would run it (``hf.weight_kernels_available``:
    checked on CUDA machines only, before spawning and in ``parallelize``). The torch path is the one
    planned and tested; the kernel would compute ``out_proj`` without its all-reduce."""
    if not weight_kernels_available():
        return
    for fqn, style in plan.styles.items():
        module = model.get_submodule(fqn)
        if style == Style.PER_CHANNEL and (kernel := weight_kernel(module)):
            raise ConfigError(
                f"parallel.tp={tp}: {fqn} ({type(module).__name__}) would train through the fused kernel {kernel} "
                "here, which reads its projections' weights itself and bypasses their split; uninstall mamba-ssm "
                "(and unset TRANSFORMERS_USE_HUB_KERNELS) for the split torch path, or use parallel.fsdp instead of tp"
            )


def _chunked(plan: Plan, linear: str, tp: int) -> bool:
    """Whether each rank computes its chunk of every part of sliced ``linear`` (unequal parts, as
    Mamba-2's [z, x, B, C, dt]), so that what follows a run of its parts takes its chunk of each too."""
    parts, whole = plan.parts.get(linear), plan.whole_parts.get(linear)
    return parts is not None and plan.sliced[linear] == [rank_rows(parts, r, tp, whole) for r in range(tp)]


def channel_placements(model: nn.Module, plan: Plan) -> dict[str, dict[str, ExpertParam]]:
    """The placement of each parameter of the ``per_channel`` modules (their ``Plan.experts``
    entries): dim 0 split like the channels it meets (its chunk of each of their parts), or
    whole where each rank uses rows of it (``param_rows``)."""
    placements: dict[str, dict[str, ExpertParam]] = {}
    for fqn, params in plan.channels.items():
        placements[fqn] = {}
        for pname, source in params.items():
            parts = plan.channel_parts.get(f"{fqn}.{pname}")
            if parts is None and plan.styles[source] == Style.PACKED_COLWISE:
                parts = plan.parts[source]
            dim = channel_dim(plan, fqn, pname, getattr(model.get_submodule(fqn), pname))  # along the channels
            if param_rows(plan, fqn, pname) is not None:
                placements[fqn][pname] = ExpertParam(None)  # stored whole, each rank uses its rows
            elif parts is not None:
                placements[fqn][pname] = ExpertParam(dim, len(parts), sizes=tuple(parts) if len(set(parts)) > 1 else ())
            else:
                placements[fqn][pname] = ExpertParam(dim)
    return placements


def _held_whole(plan: Plan, linear: str, width: int) -> bool:
    """Whether column-parallel ``linear`` (of ``width`` outputs) computes all its rows on every rank."""
    return linear in plan.sliced and all(sum(b - a for a, b in rows) == width for rows in plan.sliced[linear])


def local_sizes(
    model: nn.Module,
    plan: Plan,
    reads: dict[str, set[str]],
    split_sizes: dict[str, set[int]],
    tp: int,
    split_only: dict[str, set[str]] | None = None,
) -> None:
    """``plan.local_sizes``: in ``per_channel`` modules (mixers; attention's sizes are set from its
    head counts by ``local_geometry.localize_geometry``), every int attribute the forward reads that equals a
    split width of one of its linears (its output width, or one of its packed parts) or the size
    of a split dim of a tensor its own code made (``split_sizes``: Qwen3-Next's ``num_k_heads``,
    its heads viewed out of the fused projection), and is not a head width (unless only ever used
    as the size of a split dim: ``split_only``, ``sizes.py``): divided by tp, or its share of a
    run of parts some held whole (``rows.local_width``)."""
    heads = all_head_widths(model.config)  # never split (Llama's head_dim is its kv width at 1 kv head)
    for fqn, names in reads.items():
        module = model.get_submodule(fqn)
        if fqn not in plan.channels:
            continue  # attention: ``localize_geometry`` sets its sizes from the head counts
        names = {n for n in names if getattr(module, n) not in heads or n in (split_only or {}).get(fqn, ())}
        widths: set[int] = set(split_sizes.get(fqn, ()))
        for child, style in plan.styles.items():
            if child.rpartition(".")[0] == fqn and style in (Style.COLWISE, Style.PACKED_COLWISE):
                if _held_whole(plan, child, out_features(model.get_submodule(child))):
                    continue  # a low-rank latent, whole on every rank: its width is no split one (HY-v4's q_a_proj)
                widths |= {out_features(model.get_submodule(child)), *plan.parts.get(child, [])}
        found = {n: getattr(module, n) for n in sorted(names) if getattr(module, n) in widths}
        packed = [(plan.parts[c], plan.whole_parts[c]) for c in plan.whole_parts if c.rpartition(".")[0] == fqn]
        found = {n: _local(v, packed, tp) for n, v in found.items()}
        found = {n: v for n, v in found.items() if v != getattr(module, n)}  # a whole part's size stays
        if found:
            plan.local_sizes[fqn] = found


def keep_whole_widths(model: nn.Module, plan: Plan, whole: dict[str, set[str]]) -> None:
    """In attention modules, a head-concatenation width attribute (``local_geometry.WIDTH_ATTRS``) the
    forward uses only as a whole size (``sizes.py``: Zaya's CCA projection makes its delayed value's
    first input ``new_zeros(batch, 1, self.hidden_size)``, equal to heads x head_dim) keeps its value
    (``Plan.local_sizes``), where ``localize_geometry`` would divide it by tp."""
    for fqn in plan.attention:
        module = model.get_submodule(fqn)
        for attr in sorted(whole.get(fqn, set()) & set(WIDTH_ATTRS)):
            plan.local_sizes.setdefault(fqn, {}).setdefault(attr, getattr(module, attr))


def _local(width: int, packed: list[tuple[list[int], list[bool]]], tp: int) -> int:
    """A split width on one rank: ``width // tp``, or a share of a run of parts some held whole."""
    shares = {local_width(parts, whole, width, tp) for parts, whole in packed} - {None}
    return shares.pop() if len(shares) == 1 else width // tp
