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

import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlm.parallel.infer.head_einsums import per_head_modules, watch_per_head
from shardlm.parallel.infer.probe import RunWhole
from shardlm.parallel.infer.sizes import holds_linear, watch_reads
from shardlm.parallel.infer.trace_hooks import TraceHooks
from shardlm.parallel.infer.trace_result import Traced, collect
from shardlm.parallel.infer.tracker import ShardTracker
from shardlm.parallel.model.experts import is_experts_like
from shardlm.parallel.model.hf import (
    all_head_widths,
    head_counts,
    is_conv1d,
    is_linear,
)
from shardlm.parallel.model.meta import build_meta

RUNNING_NOTE = "while running "  # the note ``trace_model`` adds to an exception: the module whose forward raised it


TRACE_SEQ = 13  # a prime, unlikely to equal a head count, so per-head tensors are told from per-position ones


def sequence_length(config, length: int) -> int:
    """``length``, or the length the config demands of training sequences near it, as training data would
    have to honour it: a multiple of every ``*chunk_length`` (Reformer's attention chunks) and exactly the
    product of ``axial_pos_shape`` where axial position embeddings are on (Reformer's, in training)."""
    if getattr(config, "axial_pos_embds", False) and isinstance(getattr(config, "axial_pos_shape", None), list):
        return math.prod(config.axial_pos_shape)
    chunks = [v for k, v in config.to_dict().items() if k.endswith("chunk_length") and type(v) is int and v > 1]
    multiple = math.lcm(*chunks) if chunks else 1
    return -(-length // multiple) * multiple


def meta_forward(
    meta: nn.Module, shape: tuple[int, int] = (1, TRACE_SEQ), probes: dict[str, nn.Module] | None = None
) -> None:
    """One forward of ``meta`` on a batch of ``shape`` (its length as the config demands: ``sequence_length``).
    ``torch.distributions`` check their arguments' values (BLT's patcher takes the entropy of a
    ``Categorical``), which meta tensors do not hold: the checks are off while it runs (only values are
    checked; shapes are still computed). ``probes``: modules kept whole, run on CPU tensors (``probe.py``).
    Per-expert linear modules (JetMoE's) run a stand-in: ``_every_token_to_one_expert``."""
    shape = (shape[0], sequence_length(meta.config, shape[1]))
    validate = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    stand_ins = [m for m in meta.modules() if is_experts_like(m)]
    for m in stand_ins:  # JetMoE's per-expert linears: their routing's token counts are read to the host
        m.forward = types.MethodType(_every_token_to_one_expert, m)
    try:
        with RunWhole(meta, probes):
            meta(input_ids=torch.zeros(shape, dtype=torch.long, device="meta"))
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)
        for m in stand_ins:
            del m.forward


def trace_model(
    model: nn.Module,
    forced: frozenset[str] = frozenset(),
    meta: nn.Module | None = None,
    shape: tuple[int, int] = (1, TRACE_SEQ),
    latents: frozenset[str] = frozenset(),
    wholes: frozenset[tuple[str, int, int]] = frozenset(),
    probes: dict[str, nn.Module] | None = None,
    narrowed: frozenset[str] = frozenset(),
) -> Traced:
    """Directions of every linear inside the decoder blocks, packed parts, and the dropout call
    sites, from one meta forward of a ``shape`` batch; ``forced``: linears kept replicated (their
    outputs are whole on every rank); ``meta``: a meta copy of ``model`` to trace (built if not
    given; the trace leaves it as is); ``latents``: forced linears whose outputs are low-rank
    latents read per head (``latent.py``): the modules reading them and what they meet are recorded;
    ``probes``: modules kept whole, run on CPU tensors (``probe.py``); ``narrowed``: row-parallel linears
    whose output each rank narrows to its heads' columns (``narrowed.py``)."""
    meta = meta if meta is not None else build_meta(model)
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
    tracker.narrowed = narrowed
    tracker.seq = shape[1]
    for m_name, m in meta.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            if id(p) in tracker.tied:
                tracker.tied_owners.setdefault(id(p), {})[m_name] = f"{m_name} ({type(m).__name__})"
    tracker.params = {id(p): p for p in meta.parameters()}
    tracker.buffers = {id(b): name for name, b in meta.named_buffers()}
    tracker.embedding_params = {id(p) for p in meta.get_input_embeddings().parameters()}  # ``head_inputs.py``
    hooks = TraceHooks(tracker, forced, latents, all_head_widths(meta.config), legit)
    hooks.block_prefixes = tuple(f"{name}." for name, m in meta.named_modules() if isinstance(m, nn.ModuleList))
    watch_per_head(tracker, meta, per_head_modules(meta, hooks.block_prefixes, forced))  # XLNet's einsums
    tracker.direct_weights = {
        id(m.weight): name
        for name, m in meta.named_modules()
        if is_linear(m) and name.startswith(hooks.block_prefixes) and name not in forced and not is_conv1d(m)
    }
    hooks.install(meta)
    reads: dict[str, set[str]] = {}
    # keyed by the module itself: a forward may replace a submodule (BigBird's ``set_attention_type`` swaps in
    # another attention class, keeping its linears), and the new one must not get the old one's class back
    watched = [
        (m, watch_reads(m, reads.setdefault(name, set()), name)) for name, m in meta.named_modules() if holds_linear(m)
    ]
    try:
        with tracker:
            meta_forward(meta, shape, probes)
    except Exception as exc:
        if hooks.running:
            running = hooks.running[-1]
            exc.add_note(f"{RUNNING_NOTE}{running} ({type(meta.get_submodule(running)).__name__})")
        raise
    finally:
        hooks.remove()
        for module, cls in watched:
            module.__class__ = cls
    for name in (probes or {}).keys() & hooks.ran:  # run whole on CPU tensors: everything under it ran too
        hooks.ran |= {n for n, _ in meta.get_submodule(name).named_modules(prefix=name)}
    return collect(meta, tracker, hooks, reads, wholes)


def _every_token_to_one_expert(module: nn.Module, inputs: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The meta stand-in of a per-expert linear module (``is_experts_like``: JetMoE's ``[E, out, in]`` weight,
    its rows grouped by expert counts its router reads to the host, which meta tensors cannot give): every
    row through the first expert's matrix, the dataflow (a linear of its weight) and shapes its forward has."""
    return F.linear(inputs, module.weight[0])


def dropout_dims(
    model: nn.Module, traced: Traced, forced: frozenset[str], probes: dict[str, nn.Module] | None = None
) -> list[int | None]:
    """The sharded dim of each dropout site's input (see ``Plan.dropout_sites``).

    Shardedness is known per tensor, not per dim, so a second trace with another batch size and
    sequence length tells the batch/sequence dims (their sizes change) from the feature dims
    (they do not); the sharded one is the first feature dim: heads in ``[batch, heads, q, k]``
    attention probabilities, features in ``[batch, seq, ffn]`` or ``[batch*seq, ffn]``. The
    second trace runs only for a model that drops on a sharded tensor (p > 0); other sharded
    sites get -1, which ``dropout.traced_dim`` refuses should one ever draw a mask.
    """
    sites = traced.dropout_sites
    if not any(sharded and p > 0 and known is None for sharded, _, p, known in sites):
        return [known if known is not None else -1 if sharded else None for sharded, _, _, known in sites]
    other = trace_model(model, forced, shape=(2, 5), probes=probes).dropout_sites
    if len(other) != len(sites):
        raise RuntimeError(f"dropout call sites differ between two traces ({len(sites)} vs {len(other)})")
    dims: list[int | None] = []
    for (sharded, a, _, known), (_, b, _, _) in zip(sites, other):
        fixed = [d for d in range(len(a)) if len(a) == len(b) and a[d] == b[d]]
        dims.append(known if known is not None else (fixed[0] if fixed else -1) if sharded else None)
    return dims
