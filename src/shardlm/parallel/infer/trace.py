"""The trace behind AutoTP: one forward on the meta device that tracks which tensors are split.

The algorithm (no table of model names): run one forward of the model on the meta device
under a ``TorchFunctionMode`` (``tracker.py``) that tracks which tensors are *sharded* across TP ranks. A
linear layer that reads an unsharded tensor becomes column-parallel and its output is
sharded; every op propagates shardedness from inputs to outputs; a linear that reads a
sharded tensor becomes row-parallel and its output, all-reduced, is unsharded again. This is
the Megatron pairing (q/k/v/gate/up/fc1 -> o/down/fc2) found from the dataflow, so parallel
attention+MLP blocks (GPT-NeoX, Falcon) and models with no hand-written plan (OPT, GPT-2)
need nothing special. The first op that consumes a colwise output tells whether the
projection is fused: a split/chunk/slice of the last dim means packed parts (GPT-2 c_attn,
Phi-3 qkv_proj and gate_up_proj: ``parts.py``); a view into heads means per-head interleaving (GPT-NeoX),
which plain column sharding already keeps whole. A module with parameters that reads a
sharded tensor gets ``replicate_grad_allreduce``, unless its parameter spans the sharded
width (OLMo-2's full-width q/k norm): an RMSNorm there becomes ``sharded_norm`` (anything
else is a violation: ``checks.py``). A parameter (or a tensor computed from one alone) whose first dim
is the output width of the one column-parallel linear a split tensor came from, meeting that
tensor along its channel dim (a depthwise convolution with ``groups`` equal to it, or a broadcast
elementwise op), *follows* the split (``follow.py``; ``channels.py`` splits it the
same way): Qwen3.5 DeltaNet's conv1d weight, ``A_log``, ``dt_bias``. A fused projection whose
output is cut into parts only later, after such per-channel ops (DeltaNet's q/k/v, convolved
first), is found packed at that cut (``later_parts``); a cut of a stretch of a linear's output
(Mamba-2's x|B|C, cut again after its conv) refines that linear's parts (``layouts.Cuts``). A
stretch an einsum sums over its split channels (Mamba-2's B and C with fewer groups than tp) is
held whole on every rank and the model traced again (``wholes.py``); a module with one
parameter of the split width is judged by its ops (``ShardTracker.deferred``: a norm over groups
the split keeps whole has its weight follow the channels). A tensor made at a size read off a split
tensor's shape (a recurrent state ``zeros(batch, value.shape[-2], ...)``) is per head at each
rank's own head count, unlike ALiBi slopes made from the config's; so is a tensor broadcast to
such a size (MLA's one rope key expanded over the heads) when it belongs to a low-rank latent
(``latent.py``: its gradient is summed over TP at the latent's input). A row-parallel output read
back inside the split region (Mamba-1's ``x_proj``: whole dt, B, C meeting each rank's channels)
has its gradient summed over TP, and a linear whose weight its parent multiplies directly there
(``dt_proj.weight @ dt``) is column-parallel (``summed.py``). The model's own
``base_model_tp_plan`` is used as a cross-check of the colwise/rowwise directions.

Data-dependent questions modeling files ask (``pad_token_id in input_ids``, ``mask.all()``,
``.item()``, ``nonzero``) are answered on meta without data (``meta_answers.py``); the trace
uses batch 1 and a prime sequence length (``TRACE_SEQ``) so per-head and per-position sizes
cannot be confused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from shardlm.parallel.infer.latent import latent_candidates
from shardlm.parallel.infer.parts import parts_from_consumer, refined
from shardlm.parallel.infer.sizes import holds_linear, watch_reads
from shardlm.parallel.infer.summed import track_output
from shardlm.parallel.infer.tracker import ShardTracker
from shardlm.parallel.infer.wholes import whole_flags
from shardlm.parallel.model.hf import (
    all_head_widths,
    gates_before_norm,
    head_counts,
    is_conv1d,
    is_linear,
    out_features,
    rms_norm_eps,
)
from shardlm.parallel.model.meta import build_meta

RUNNING_NOTE = "while running "  # the note ``trace_model`` adds to an exception: the module whose forward raised it


TRACE_SEQ = 13  # a prime, unlikely to equal a head count, so per-head tensors are told from per-position ones


def meta_forward(meta: nn.Module, shape: tuple[int, int] = (1, TRACE_SEQ)) -> None:
    meta(input_ids=torch.zeros(shape, dtype=torch.long, device="meta"))


@dataclass
class Traced:
    styles: dict[str, str]
    parts: dict[str, list[int]]
    violations: list[tuple[frozenset[str], str]]
    closer_inputs: dict[str, frozenset[str]]  # rowwise linear -> sources of what it reads
    views: dict[str, tuple[int, ...]]  # colwise linear -> shape of the first view of its output
    foreign: dict[str, str]  # owner of a parameter -> another module whose forward used it directly
    dropout_sites: list[tuple[bool, tuple[int, ...], float]]  # see ``ShardTracker.dropout_sites``
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


def trace_model(
    model: nn.Module,
    forced: frozenset[str] = frozenset(),
    meta: nn.Module | None = None,
    shape: tuple[int, int] = (1, TRACE_SEQ),
    latents: frozenset[str] = frozenset(),
    wholes: frozenset[tuple[str, int, int]] = frozenset(),
) -> Traced:
    """Directions of every linear inside the decoder blocks, packed parts, and the dropout call
    sites, from one meta forward of a ``shape`` batch; ``forced``: linears kept replicated (their
    outputs are whole on every rank); ``meta``: a meta copy of ``model`` to trace (built if not
    given; the trace leaves it as is); ``latents``: forced linears whose outputs are low-rank
    latents read per head (``latent.py``): the modules reading them and what they meet are recorded."""
    meta = meta if meta is not None else build_meta(model)
    styles: dict[str, str] = {}
    registrations: dict[int, int] = {}
    for _, m in meta.named_modules():
        for p in m.parameters(recurse=False):
            registrations[id(p)] = registrations.get(id(p), 0) + 1
    param_owner = {
        id(p): f"{m_name} ({type(m).__name__})"
        for m_name, m in meta.named_modules()
        for p in m.parameters(recurse=False)
    }
    legit: dict[str, bool] = {}
    tracker = ShardTracker(param_owner, legit, head_counts(meta.config), wholes)
    tracker.tied = {i for i, n in registrations.items() if n > 1}
    tracker.params = {id(p): p for p in meta.parameters()}
    tracker.buffers = {id(b): name for name, b in meta.named_buffers()}
    outputs: dict[str, torch.Tensor] = {}
    closer_inputs: dict[str, frozenset[str]] = {}
    hooks = []
    running: list[str] = []  # modules whose forward is running (named when an exception escapes)
    tracker.running = running
    block_prefixes = tuple(f"{name}." for name, m in meta.named_modules() if isinstance(m, nn.ModuleList))
    widths_of_heads = all_head_widths(meta.config)
    tracker.direct_weights = {
        id(m.weight): name
        for name, m in meta.named_modules()
        if is_linear(m) and name.startswith(block_prefixes) and name not in forced and not is_conv1d(m)
    }

    def pre(name):
        label = f"{name} ({{}})"

        def hook(module, args):
            running.append(name)
            tracker.shape_heads.clear()
            if not args or not isinstance(args[0], torch.Tensor):
                return
            if id(args[0]) in tracker.latent and any(True for _ in module.parameters(recurse=False)):
                tracker.latent_readers[name] = tracker.latent[id(args[0])]
            if id(args[0]) in tracker.rows and any(True for _ in module.parameters(recurse=False)):
                tracker.rows_readers[name] = tracker.rows[id(args[0])]
            sources = tracker.sources(args[0])
            owner = label.format(type(module).__name__)
            if is_linear(module) and name in forced:
                styles[name] = "replicate"
                if sources:
                    tracker.violations.append((sources, f"{owner} reads its split activations"))
            elif is_linear(module) and name.startswith(block_prefixes):
                styles[name] = "rowwise" if sources else "colwise"
                tracker.widths[name] = out_features(module)
                legit[owner] = True
                if sources:
                    closer_inputs[name] = closer_inputs.get(name, frozenset()) | sources
            elif sources and any(True for _ in module.parameters(recurse=False)):
                width = args[0].shape[-1]
                params = list(module.parameters(recurse=False))
                if all(p.dim() == 1 and p.numel() == width for p in params) and width in widths_of_heads:
                    styles[name] = "replicate_grad_allreduce"  # per head (Qwen3's q_norm/k_norm)
                    legit[owner] = True
                    tracker.inside.append(name)
                elif (
                    all(p.numel() == width for p in params)
                    and rms_norm_eps(module) is not None
                    and (len(args) < 2 or gates_before_norm(module))  # Mamba-2's gated norm, one group
                ):
                    styles[name] = "sharded_norm"  # across the whole split width (OLMo-2's q_norm)
                    legit[owner] = True
                    tracker.inside.append(name)
                else:
                    across = all(p.numel() == width for p in params)
                    why = (sources, f"{owner} {'normalizes across' if across else 'acts on'} the split width {width}")
                    if across and len(params) == 1:
                        # perhaps a norm over groups that the split keeps whole (Mamba-2's gated norm at
                        # n_groups divisible by tp): its ops decide (``ShardTracker.deferred``)
                        tracker.deferred.append((name, why, len(tracker.violations)))
                    else:
                        tracker.violations.append(why)

        return hook

    def post(name):
        def hook(module, args, out):
            if running and running[-1] == name:
                running.pop()
            if tracker.inside and tracker.inside[-1] == name:
                tracker.inside.pop()
            if tracker.deferred and tracker.deferred[-1][0] == name:
                _, why, start = tracker.deferred.pop()
                if len(tracker.violations) > start or any(id(p) not in tracker.follows for p in module.parameters()):
                    tracker.violations.insert(start, why)
            tracker.returned |= {id(t) for t in tree_flatten(out)[0] if isinstance(t, nn.Parameter)}
            if isinstance(out, torch.Tensor) and styles.get(name) in ("colwise", "rowwise", "replicate"):
                tracker.mark(out, frozenset({name}) if styles[name] == "colwise" else None)
                if styles[name] == "colwise":
                    tracker.layouts[id(out)] = (-1, (out.shape[-1],))
                    tracker.cuts.origins[id(out)] = (name, 0)
                outputs[name] = out
            track_output(tracker, name, out, styles.get(name) == "rowwise")
            if name in latents and isinstance(out, torch.Tensor):
                tracker.latent[id(out)] = frozenset({name})
            for t in tree_flatten(out)[0]:
                for fqn in tracker.latent.get(id(t), ()) if isinstance(t, torch.Tensor) else ():
                    if not name.startswith(f"{fqn.rpartition('.')[0]}."):  # it leaves the module holding it
                        tracker.latent_leaks.setdefault(fqn, f"{name} returns it")

        return hook

    for name, module in meta.named_modules():
        hooks.append(module.register_forward_pre_hook(pre(name)))
        hooks.append(module.register_forward_hook(post(name)))
    reads: dict[str, set[str]] = {}
    watched = {
        name: watch_reads(m, reads.setdefault(name, set()), name) for name, m in meta.named_modules() if holds_linear(m)
    }
    try:
        with tracker:
            meta_forward(meta, shape)
    except Exception as exc:
        if running:
            exc.add_note(f"{RUNNING_NOTE}{running[-1]} ({type(meta.get_submodule(running[-1])).__name__})")
        raise
    finally:
        for h in hooks:
            h.remove()
        for name, cls in watched.items():
            meta.get_submodule(name).__class__ = cls
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
        latent_candidates(tracker, styles, outputs, closer_inputs),
        {name: set(fqns) for name, fqns in tracker.latent_readers.items()},
        dict(tracker.latent_leaks),
        direct,
        summed,
        {name: set(fqns & summed) for name, fqns in tracker.rows_readers.items() if fqns & summed},
    )


def dropout_dims(model: nn.Module, traced: Traced, forced: frozenset[str]) -> list[int | None]:
    """The sharded dim of each dropout site's input (see ``Plan.dropout_sites``).

    Shardedness is known per tensor, not per dim, so a second trace with another batch size and
    sequence length tells the batch/sequence dims (their sizes change) from the feature dims
    (they do not); the sharded one is the first feature dim: heads in ``[batch, heads, q, k]``
    attention probabilities, features in ``[batch, seq, ffn]`` or ``[batch*seq, ffn]``. The
    second trace runs only for a model that drops on a sharded tensor (p > 0); other sharded
    sites get -1, which ``dropout.traced_dim`` refuses should one ever draw a mask.
    """
    sites = traced.dropout_sites
    if not any(sharded and p > 0 for sharded, _, p in sites):
        return [-1 if sharded else None for sharded, _, _ in sites]
    other = trace_model(model, forced, shape=(2, 5)).dropout_sites
    if len(other) != len(sites):
        raise RuntimeError(f"dropout call sites differ between two traces ({len(sites)} vs {len(other)})")
    dims: list[int | None] = []
    for (sharded, a, _), (_, b, _) in zip(sites, other):
        fixed = [d for d in range(len(a)) if len(a) == len(b) and a[d] == b[d]]
        dims.append((fixed[0] if fixed else -1) if sharded else None)
    return dims
