"""AutoTP: derive a tensor-parallel plan for a Hugging Face causal LM from its dataflow.

A plan is ``{module_fqn: style}``; the style vocabulary (``styles.Style``; what each shards: ``styles.PLACEMENTS``):

``colwise``  Linear/Conv1D sharded by output features: it reads a replicated activation
``rowwise``  Linear/Conv1D sharded by input features: it reads a sharded activation and its
             output is all-reduced (back into the residual stream)
``packed_colwise``  a fused colwise projection (qkv, gate_up, GPT-2's c_attn) whose output is
             split into parts downstream: each part is sharded on its own, so every rank holds
             whole heads / matching halves
``embedding`` token embedding sharded by vocabulary rows
``lm_head``  output projection sharded by vocabulary; the loss runs on the vocab shards
``replicate_grad_allreduce``  parameters acting on sharded activations per head (Qwen3's
             q_norm/k_norm): replicated, gradients summed over the TP group
``sharded_norm``  an RMSNorm across a whole sharded width (OLMo-2's q_norm/k_norm after
             column-parallel q/k): weight sharded like its input, the mean of squares all-reduced
``replicate`` every other module owning parameters (norms, linears of sub-blocks kept whole); in
             a finished plan it becomes ``replicate_local`` or ``replicate_own`` (below)
``replicate_local``  learned position embeddings (they make position tensors of their own), and
             a module that uses its children's parameters directly (a mixer calling
             ``conv1d(x, self.conv1d.weight)``) with everything under it, none of it split:
             parameters replicated, the module computes on local views of them; also every
             ``replicate`` module with nothing split under it (``_run_local``)
``replicate_own``  a module with parameters of its own around split children (HRM's initial
             state): its own parameters only, replicated, computed on as local views

The algorithm (no table of model names): run one forward of the model on the meta device
under a ``TorchFunctionMode`` that tracks which tensors are *sharded* across TP ranks. A
linear layer that reads an unsharded tensor becomes column-parallel and its output is
sharded; every op propagates shardedness from inputs to outputs; a linear that reads a
sharded tensor becomes row-parallel and its output, all-reduced, is unsharded again. This is
the Megatron pairing (q/k/v/gate/up/fc1 -> o/down/fc2) found from the dataflow, so parallel
attention+MLP blocks (GPT-NeoX, Falcon) and models with no hand-written plan (OPT, GPT-2)
need nothing special. The first op that consumes a colwise output tells whether the
projection is fused: a split/chunk/slice of the last dim means packed parts (GPT-2 c_attn,
Phi-3 qkv_proj and gate_up_proj); a view into heads means per-head interleaving (GPT-NeoX),
which plain column sharding already keeps whole. A module with parameters that reads a
sharded tensor gets ``replicate_grad_allreduce``, unless its parameter spans the sharded
width (OLMo-2's full-width q/k norm): an RMSNorm there becomes ``sharded_norm`` (anything
else is a violation, below). The model's own
``base_model_tp_plan`` is used as a cross-check of the colwise/rowwise directions.

What cannot be split is kept replicated, sub-block by sub-block, or refused; never guessed:

* every split tensor carries its *sources* (the column-parallel linears it came from). A module
  or parameter that would act on split activations and is none of the above (a depthwise
  ``conv1d`` of a short-convolution or Mamba mixer, a state-space parameter, a learned
  activation), or a per-head tensor that is not split with the heads (BLOOM's and MPT's ALiBi
  slopes, position biases: found as a non-parameter tensor sharing the head-count dim of a split
  one, the trace using batch 1 and a prime sequence length so the sizes cannot be confused), is
  a *violation*: its sources, the row-parallel linears reading them and the column-parallel
  linears feeding those stay replicated (``Plan.replicated``, with the reason) and the trace runs
  again. Replicated modules compute the whole sub-block on every rank: exact, just not split.
* the plan is then dry-run on meta at one rank's shapes (``_dry_run``): what only breaks there
  (Falcon's multi-query ``num_heads + 2`` reshape, GPT-BigCode's multi-query split sizes) or
  silently regroups (CodeGen's qkv fused in ``mp_num`` groups of ``[q, v, k]``, whose local
  reshape runs but groups the wrong columns) keeps the owning sub-block replicated too.
* a module whose code uses its children's parameters directly (Mamba and short-convolution
  mixers call ``conv1d(x, self.conv1d.weight)``), with nothing under it split, becomes
  ``replicate_local``, and so does a module with parameters of its own around whole children
  (gpt-oss's attention, kept whole, owns per-head sinks: ``_run_local``); where
  something under it is split, or a parameter is shared by modules of different styles (BERT's
  LM-head bias), the model is refused (``_refuse_unplaceable``).
* mixture-of-experts layers whose experts are fused 3-D parameters (transformers 5's
  ``...Experts`` modules) get the ``experts`` style: each expert's intermediate dim split, the
  placement of every parameter found by a probe run of the module (``parallel/experts.py``), the
  router and shared experts placed by the trace like any other module; the trace runs the
  experts eagerly (on meta the loop over hit experts is empty: they are opaque to it). Any other
  MoE layer is refused by name (``experts.refuse_unhandled_moe``); so is a model none of whose
  block layers can be split (Mamba, RWKV), and any unexpected exception while tracing becomes a
  one-line ``ConfigError`` naming the module that was running: ``shardlm plan`` and ``train``
  never show a traceback, and ``parallel.fsdp`` trains all of these.
* data-dependent questions modeling files ask (``pad_token_id in input_ids``, ``mask.all()``,
  ``.item()``, ``nonzero``) are answered on meta without data (``_DATA_DEPENDENT``).

Two cases keep their style word but are recorded in ``Plan.sliced`` (output rows each rank
computes) and stored *replicated* on the TP mesh, gradients summed over TP:

* fewer key/value heads than ``tp`` (GQA, MQA): a k/v projection (a colwise linear of width
  ``kv_heads * head_dim`` beside a query projection) is held whole; rank r computes only the kv
  head its query heads read, ``r // (tp // kv_heads)``. Ranks sharing a kv head each produce
  part of its gradient (the part from their query heads); rows of other heads get zero, so the
  sum over TP is the full gradient.
* a packed projection of *unequal* parts (Phi-3 with GQA: q ``H*d``, k and v ``KV*d``), which
  ``_StridedShard`` cannot express: held whole, rank r computes its chunk of every part (or its
  replicated kv head when ``KV < tp``).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from shardlm.errors import ConfigError
from shardlm.parallel.dropout import dropout_input_shape, dropout_p, is_dropout_call
from shardlm.parallel.experts import describe_experts, find_experts, place_experts
from shardlm.parallel.hf import (
    MODULE_KV_COUNT_ATTRS,
    geometry,
    head_counts,
    head_widths,
    is_conv1d,
    is_linear,
    out_features,
    rms_norm_eps,
)
from shardlm.parallel.plan import Plan
from shardlm.parallel.styles import SPLIT_LINEAR, SPLIT_STYLES, local_shape, sharded_dim
from shardlm.parallel.tp import localize_geometry

# torch ops by which a consumer cuts a fused projection's output into parts along the last dim
_SPLIT_OPS = {"split", "chunk", "split_with_sizes", "tensor_split", "unbind"}
_VIEW_OPS = {"view", "reshape", "unflatten"}
# answers for data-dependent questions a modeling file asks of a meta tensor during the trace
# ("is a pad token in input_ids?", "is this a packed sequence?"): meta tensors hold no data
_DATA_DEPENDENT = {
    "item": 0,
    "__bool__": False,
    "__int__": 0,
    "__index__": 0,
    "__float__": 0.0,
    "tolist": [],
    "__contains__": False,
    "equal": False,
    "allclose": False,
    "is_nonzero": False,
}
_NO_ROWS = {"nonzero", "argwhere"}  # data-dependent shapes: answered as "no element matches"
# ops that reduce along a dim: over the split width of a flat column-parallel output, each rank
# would reduce its own columns only (a parameter-free norm, a softmax gate)
_REDUCTIONS = {
    "sum", "mean", "softmax", "log_softmax", "norm", "var", "std", "var_mean", "std_mean", "amax", "amin",
    "max", "min", "argmax", "argmin", "topk", "sort", "argsort", "cumsum", "cumprod", "logsumexp", "prod",
    "layer_norm", "rms_norm", "group_norm", "normalize", "vector_norm", "linalg_vector_norm",
}  # fmt: skip
_RUNNING = "while running "  # the note ``_trace`` adds to an exception: the module whose forward raised it
TRACE_SEQ = 13  # a prime, unlikely to equal a head count, so per-head tensors are told from per-position ones


class _ShardTracker(TorchFunctionMode):
    """Propagates 'sharded across TP ranks' through every torch op of a meta forward.

    Each sharded tensor carries its *sources*: the column-parallel linears whose outputs it was
    computed from. When something cannot act on a sharded tensor (a parameter of a module that
    is not split with it, a per-head tensor that is not split with the heads), the sources are
    recorded as a violation: ``_trace`` then keeps that whole sub-block replicated.
    """

    def __init__(self, param_owner: dict[int, str] | None = None, legit: dict | None = None, heads=()) -> None:
        super().__init__()
        self.sharded: dict[int, frozenset[str]] = {}
        self.keep: list[torch.Tensor] = []  # keeps traced tensors alive so ids stay unique
        self.first_consumer: dict[int, tuple[str, tuple]] = {}
        self.slices: dict[int, set[int]] = {}
        self.param_owner = param_owner or {}
        self.legit = legit if legit is not None else {}  # fqns whose parameters may meet sharded tensors
        self.heads = {h for h in heads if h > 1}
        self.violations: list[tuple[frozenset[str], str]] = []
        self.first_view: dict[int, tuple[int, ...]] = {}  # id(tensor) -> shape of its first view/reshape
        self.widths: dict[str, int] = {}  # column-parallel linear -> its output width
        self.running: list[str] = []  # modules whose forward is running, innermost last
        self.foreign: dict[str, str] = {}  # owner of a parameter -> the module whose forward used it
        self.tied: set[int] = set()  # parameters registered in several modules (tied embeddings)
        # parameters a module's forward returns (GPT-NeoX-Japanese's attention returns its
        # ``dense_bias`` for the layer to add): the caller receives the local view its style made
        self.returned: set[int] = set()
        # id(tensor) -> owners of the parameters it is computed from alone (DiffLlama's
        # ``exp(sum(lambda_q1 * lambda_k1))``): such a tensor meeting split activations is a parameter
        # meeting them (each rank would compute its gradient from its own heads only)
        self.from_params: dict[int, frozenset[str]] = {}
        self.inside: list[str] = []  # running modules whose own math on split tensors is handled by their style
        # per dropout call: (input sharded, its shape, its probability)
        self.dropout_sites: list[tuple[bool, tuple[int, ...], float]] = []

    def _record_dropout(self, func, args, kwargs) -> None:
        """A dropout call site (``dropout.is_dropout_call``): is its input sharded, its shape, its p."""
        if is_dropout_call(func):
            x = args[0] if args else kwargs.get("input", kwargs.get("query"))
            sharded = any(self.is_sharded(t) for t in tree_flatten((args, kwargs))[0])
            self.dropout_sites.append(
                (sharded, dropout_input_shape(func, args, kwargs, x), dropout_p(func, args, kwargs))
            )

    def mark(self, t: torch.Tensor, sources: frozenset[str] | None) -> None:
        self.keep.append(t)
        if sources:
            self.sharded[id(t)] = sources
        else:
            self.sharded.pop(id(t), None)

    def is_sharded(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.sharded

    def sources(self, t) -> frozenset[str]:
        return self.sharded.get(id(t), frozenset()) if isinstance(t, torch.Tensor) else frozenset()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            if name in _DATA_DEPENDENT:
                return _DATA_DEPENDENT[name]
            if name in _NO_ROWS:
                if kwargs.get("as_tuple") or (len(args) > 1 and args[1] is True):
                    return tuple(torch.empty(0, dtype=torch.long, device="meta") for _ in range(args[0].dim()))
                return torch.empty((0, args[0].dim()), dtype=torch.long, device="meta")
        self._record_dropout(func, args, kwargs)
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # every tensor seen stays alive until the trace ends: records are keyed by id(), and a
        # freed tensor's id can be reused (that made packed detection nondeterministic)
        self.keep.extend(inputs)
        self.keep.extend(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        for t in inputs:
            self.first_consumer.setdefault(id(t), (name, args[1:] if args and args[0] is t else args))
            if (
                isinstance(t, nn.Parameter)
                and id(t) in self.param_owner
                and id(t) not in self.tied | self.returned
                and self.running
            ):
                owner = self.param_owner[id(t)]
                if owner.split(" (")[0] != self.running[-1]:
                    self.foreign.setdefault(owner, self.running[-1])
        if name in _VIEW_OPS and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            self.first_view.setdefault(id(args[0]), tuple(out.shape))
        if name == "__getitem__" and args and isinstance(args[0], torch.Tensor):
            self._record_slice(args[0], args[1])
        sources = frozenset().union(*(self.sharded.get(id(t), frozenset()) for t in inputs))
        if inputs and not sources and all(self._owners(t) for t in inputs):
            owners = frozenset().union(*(self._owners(t) for t in inputs))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.from_params[id(t)] = owners
        if sources:
            if not self.inside:
                self._check(name, inputs, sources)
                self._check_reduction(name, args, kwargs, sources)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark(t, sources)
        return out

    def _owners(self, t: torch.Tensor) -> frozenset[str]:
        """Owners of the parameter ``t`` or of the parameters it is computed from alone."""
        if isinstance(t, nn.Parameter):
            return frozenset({self.param_owner.get(id(t), "?")})
        return self.from_params.get(id(t), frozenset())

    def _check(self, name: str, inputs: list[torch.Tensor], sources: frozenset[str]) -> None:
        """Record what cannot act on this op's sharded input(s) as they stand."""
        sharded = [t for t in inputs if id(t) in self.sharded]
        for t in inputs:
            if id(t) in self.sharded:
                continue
            if isinstance(t, nn.Parameter):
                owner = self.param_owner.get(id(t), "?")
                if owner not in self.legit:
                    self.violations.append((sources, f"a parameter of {owner} acts on its split activations ({name})"))
            elif id(t) in self.from_params and not self.from_params[id(t)] <= self.legit.keys():
                owner = sorted(self.from_params[id(t)] - self.legit.keys())[0]
                self.violations.append(
                    (sources, f"a tensor computed from parameters of {owner} acts on its split activations ({name})")
                )
            elif t.dim() and t.numel() > 1 and self.heads:
                for s in sharded:
                    # the heads dim of split activations is never the last (that is head_dim or keys)
                    for i in range(2, min(t.dim(), s.dim()) + 1):
                        if t.shape[-i] == s.shape[-i] and t.shape[-i] in self.heads:
                            self.violations.append(
                                (
                                    sources,
                                    f"a per-head tensor of shape {tuple(t.shape)} (ALiBi slopes, position "
                                    f"biases) is not split with the heads ({name})",
                                )
                            )
                            return

    def _check_reduction(self, name: str, args: tuple, kwargs: dict, sources: frozenset[str]) -> None:
        """A reduction over the last dim of a flat column-parallel output (its width not yet viewed
        into heads) would reduce each rank's columns only."""
        if (
            name not in _REDUCTIONS
            or not args
            or not isinstance(args[0], torch.Tensor)
            or id(args[0]) not in self.sharded
        ):
            return
        t = args[0]
        if not t.dim() or t.shape[-1] not in {self.widths.get(src) for src in sources}:
            return
        if name in ("layer_norm", "rms_norm", "group_norm"):
            dims = {t.dim() - 1}
        else:
            pos = 2 if name == "topk" else 1
            dim = kwargs.get("dim", args[pos] if len(args) > pos else None)
            if isinstance(dim, torch.Tensor) or (
                name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor)
            ):
                return  # elementwise max/min of two tensors
            if dim is None and name in ("softmax", "log_softmax", "sort", "argsort", "topk", "normalize", "cumsum"):
                dim = -1
            dims = None if dim is None else {d % t.dim() for d in (dim if isinstance(dim, (tuple, list)) else [dim])}
        if dims is None or t.dim() - 1 in dims:
            self.violations.append((sources, f"{name} over the split width {t.shape[-1]}"))

    def _record_slice(self, tensor: torch.Tensor, index) -> None:
        index = index if isinstance(index, tuple) else (index,)
        if index and index[0] is Ellipsis and len(index) == 2 and isinstance(index[1], slice):
            bounds = self.slices.setdefault(id(tensor), set())
            for b in (index[1].start, index[1].stop):
                if isinstance(b, int):
                    bounds.add(b)


def _parts_from_consumer(tracker: _ShardTracker, out: torch.Tensor) -> list[int] | None:
    """Part sizes if the projection output is cut along its last dim right away, else None."""
    width = out.shape[-1]
    if id(out) in tracker.slices:
        bounds = sorted({0, width} | {b % width if b < 0 else b for b in tracker.slices[id(out)]})
        return [b - a for a, b in zip(bounds, bounds[1:])]
    name, rest = tracker.first_consumer.get(id(out), ("", ()))
    if name not in _SPLIT_OPS or not rest:
        return None
    dim = rest[1] if len(rest) > 1 else -1
    if dim not in (-1, out.dim() - 1):
        return None
    arg = rest[0]
    if name == "chunk":
        return [width // arg] * arg
    if isinstance(arg, int):
        return [arg] * (width // arg)
    return list(arg)


def _build_meta(model: nn.Module, eager: bool = True) -> nn.Module:
    """A fresh meta copy of ``model``'s architecture (``eager``: eager attention, every op visible;
    else the attention the ranks will run)."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    if eager:
        config._attn_implementation = "eager"
    # MoE: the eager experts loop (grouped_mm cannot run on meta; every kernel computes the same)
    config._experts_implementation = "eager"
    with torch.device("meta"):
        return type(model)._from_config(config)


def _meta_forward(meta: nn.Module, shape: tuple[int, int] = (1, TRACE_SEQ)) -> None:
    meta(input_ids=torch.zeros(shape, dtype=torch.long, device="meta"))


@dataclass
class _Traced:
    styles: dict[str, str]
    parts: dict[str, list[int]]
    violations: list[tuple[frozenset[str], str]]
    closer_inputs: dict[str, frozenset[str]]  # rowwise linear -> sources of what it reads
    views: dict[str, tuple[int, ...]]  # colwise linear -> shape of the first view of its output
    foreign: dict[str, str]  # owner of a parameter -> another module whose forward used it directly
    dropout_sites: list[tuple[bool, tuple[int, ...], float]]  # see ``_ShardTracker.dropout_sites``


def _trace(
    model: nn.Module,
    forced: frozenset[str] = frozenset(),
    meta: nn.Module | None = None,
    shape: tuple[int, int] = (1, TRACE_SEQ),
) -> _Traced:
    """Directions of every linear inside the decoder blocks, packed parts, and the dropout call
    sites, from one meta forward of a ``shape`` batch; ``forced``: linears kept replicated (their
    outputs are whole on every rank); ``meta``: a meta copy of ``model`` to trace (built if not
    given; the trace leaves it as is)."""
    meta = meta if meta is not None else _build_meta(model)
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
    tracker = _ShardTracker(param_owner, legit, head_counts(meta.config))
    tracker.tied = {i for i, n in registrations.items() if n > 1}
    outputs: dict[str, torch.Tensor] = {}
    closer_inputs: dict[str, frozenset[str]] = {}
    hooks = []
    running: list[str] = []  # modules whose forward is running (named when an exception escapes)
    tracker.running = running
    block_prefixes = tuple(f"{name}." for name, m in meta.named_modules() if isinstance(m, nn.ModuleList))
    widths_of_heads = head_widths(meta.config)

    def pre(name):
        label = f"{name} ({{}})"

        def hook(module, args):
            running.append(name)
            if not args or not isinstance(args[0], torch.Tensor):
                return
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
                elif all(p.numel() == width for p in params) and rms_norm_eps(module) is not None:
                    styles[name] = "sharded_norm"  # across the whole split width (OLMo-2's q_norm)
                    legit[owner] = True
                    tracker.inside.append(name)
                else:
                    what = "normalizes across" if all(p.numel() == width for p in params) else "acts on"
                    tracker.violations.append((sources, f"{owner} {what} the split width {width}"))

        return hook

    def post(name):
        def hook(module, args, out):
            if running and running[-1] == name:
                running.pop()
            if tracker.inside and tracker.inside[-1] == name:
                tracker.inside.pop()
            tracker.returned |= {id(t) for t in tree_flatten(out)[0] if isinstance(t, nn.Parameter)}
            if isinstance(out, torch.Tensor) and styles.get(name) in ("colwise", "rowwise", "replicate"):
                tracker.mark(out, frozenset({name}) if styles[name] == "colwise" else None)
                outputs[name] = out

        return hook

    for name, module in meta.named_modules():
        hooks.append(module.register_forward_pre_hook(pre(name)))
        hooks.append(module.register_forward_hook(post(name)))
    try:
        with tracker:
            _meta_forward(meta, shape)
    except Exception as exc:
        if running:
            exc.add_note(f"{_RUNNING}{running[-1]} ({type(meta.get_submodule(running[-1])).__name__})")
        raise
    finally:
        for h in hooks:
            h.remove()
    parts, views = {}, {}
    for name, style in styles.items():
        if style == "colwise" and name in outputs:
            views[name] = tracker.first_view.get(id(outputs[name]), ())[outputs[name].dim() :]
            found = _parts_from_consumer(tracker, outputs[name])
            if found and len(found) > 1:
                styles[name], parts[name] = "packed_colwise", found
    return _Traced(styles, parts, tracker.violations, closer_inputs, views, tracker.foreign, tracker.dropout_sites)


def _dropout_dims(model: nn.Module, traced: _Traced, forced: frozenset[str]) -> list[int | None]:
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
    other = _trace(model, forced, shape=(2, 5)).dropout_sites
    if len(other) != len(sites):
        raise RuntimeError(f"dropout call sites differ between two traces ({len(sites)} vs {len(other)})")
    dims: list[int | None] = []
    for (sharded, a, _), (_, b, _) in zip(sites, other):
        fixed = [d for d in range(len(a)) if len(a) == len(b) and a[d] == b[d]]
        dims.append((fixed[0] if fixed else -1) if sharded else None)
    return dims


def _hf_directions(model: nn.Module) -> dict[str, str]:
    """The model's own ``base_model_tp_plan`` reduced to colwise/rowwise per FQN, for the cross-check."""
    raw = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "model")
    out = {}
    for pattern, style in raw.items():
        direction = (
            "colwise"
            if style.startswith(("colwise", "packed_colwise"))
            else "rowwise"
            if style.startswith("rowwise")
            else None
        )
        if direction is None:
            continue
        regex = re.compile(re.escape(f"{prefix}.{pattern}").replace(r"\*", r"\d+") + "$")
        for name, _ in model.named_modules():
            if regex.match(name):
                out[name] = direction
    return out


def _module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    for name, module in model.named_modules():
        if module is target:
            return name
    return None


def infer_plan(model: nn.Module, tp: int) -> Plan:
    """The full plan for ``model`` (meta or real) at TP degree ``tp``.

    Whatever the trace cannot handle ends as a ``ConfigError`` naming the module (one line for the
    CLI, raised before any rank is spawned), never as a traceback: an unexpected exception while
    tracing means a modeling file does something the trace does not know yet, so the model is
    refused for tp > 1 rather than guessed at.
    """
    check_config_geometry(model.config, tp)
    if tp == 1:
        return Plan()
    key = (type(model).__name__, tp, json.dumps(model.config.to_dict(), sort_keys=True, default=str))
    if key not in _PLANS:
        _PLANS[key] = _infer_or_refuse(model, tp)
    return copy.deepcopy(_PLANS[key])


# plans already traced in this process (a model's plan is traced again by parallelize, estimate, LoRA checks)
_PLANS: dict[tuple, Plan] = {}


def _infer_or_refuse(model: nn.Module, tp: int) -> Plan:
    try:
        return _infer(model, tp)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring
        notes = [n[len(_RUNNING) :] for n in getattr(exc, "__notes__", ()) if n.startswith(_RUNNING)]
        where = notes[0] if notes else type(model).__name__
        detail = " ".join(str(exc).split())[:160]
        raise ConfigError(
            f"parallel.tp: {where}: tracing the tensor-parallel plan failed ({type(exc).__name__}: {detail}); "
            f"shardlm cannot split this model with tp > 1 yet, parallel.fsdp trains it"
        ) from None


_MAX_ROUNDS = 8


def _infer(model: nn.Module, tp: int) -> Plan:
    """Trace, keep replicated every sub-block something in it cannot be split, check the plan by
    running the forward at one rank's shapes (``_dry_run``), repeat until nothing changes."""
    experts = find_experts(model, tp)  # MoE: the experts modules' placements, other MoE layers refused
    forced: frozenset[str] = frozenset()
    reasons: dict[str, str] = {}
    meta = _build_meta(model)
    for _ in range(_MAX_ROUNDS):
        traced = _trace(model, forced, meta)
        # MoE: a column-parallel linear of fewer outputs than tp (Qwen2-MoE's shared_expert_gate,
        # hidden -> 1) cannot be split: it stays whole, traced again
        narrow = {f for f, st in traced.styles.items() if st == "colwise" and out_features(meta.get_submodule(f)) < tp}
        if narrow - forced:
            for f in narrow - forced:
                reasons[f] = f"{any_block(f)} has {out_features(meta.get_submodule(f))} output(s), fewer than tp={tp}"
            forced = forced | narrow
            continue
        region: set[str] = set()
        for sources, why in traced.violations:
            for fqn in _closure(traced, set(sources)) - forced - region:
                reasons.setdefault(fqn, any_block(why))
                region.add(fqn)
        if not region and not traced.violations:
            plan = _assemble(model, tp, traced)
            failure = _dry_run(model, plan, tp, traced)
            if failure is None:
                place_experts(model, plan, experts)  # MoE: the trace saw the experts replicated (opaque to it)
                _run_local(model, plan)
                _refuse_unplaceable(model, plan, traced)
                plan.dropout_sites = _dropout_dims(model, traced, forced)
                return _finish(model, plan, forced, reasons)
            owner, why = failure
            split = {f for f, st in traced.styles.items() if st in SPLIT_LINEAR}
            # its own split linears, else every split linear under it (BigBird: attention.self, .output)
            region = {f for f in split if f.rpartition(".")[0] == owner} or {
                f for f in split if f.startswith(f"{owner}.") or not owner
            }
            # the same module of every other block fails alike: one round for all of them
            region = _every_block(region, split) - forced
            why = any_block(why)
            for fqn in region:
                reasons.setdefault(fqn, why)
            if not region:
                raise ConfigError(
                    f"parallel.tp: {why}; shardlm cannot split this model with tp > 1 yet, parallel.fsdp trains it"
                )
        if not region:  # violations but nothing new to keep replicated: give up
            why = traced.violations[0][1]
            raise ConfigError(
                f"parallel.tp: {why}; shardlm cannot split this model with tp > 1 yet, parallel.fsdp trains it"
            )
        forced = forced | region
    raise ConfigError(
        f"parallel.tp: {type(model).__name__}: no consistent tensor-parallel plan after {_MAX_ROUNDS} rounds "
        f"({next(iter(reasons.values()), '')}); parallel.fsdp trains it"
    )


def _block_key(fqn: str) -> str:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.#.attn.c_attn``."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", fqn) + "."


def any_block(text: str) -> str:
    """Module names in ``text`` with their block index as ``*`` (one reason for every block)."""
    return re.sub(r"(?<=[A-Za-z_])\.\d+(?=[.\s)]|$)", ".*", text)


def _every_block(fqns: set[str], candidates: set[str]) -> set[str]:
    """``fqns`` and the same modules in every other block, among ``candidates``."""
    keys = {_block_key(f) for f in fqns}
    return {f for f in candidates if _block_key(f) in keys}


def _closure(traced: _Traced, bad: set[str]) -> set[str]:
    """``bad`` plus every row-parallel linear reading from it and every column-parallel linear
    feeding those: the whole sub-block, which then stays replicated."""
    bad = set(bad)
    changed = True
    while changed:
        changed = False
        for closer, sources in traced.closer_inputs.items():
            if sources & bad and not ({closer} | sources) <= bad:
                bad |= {closer} | sources
                changed = True
    return bad


def _assemble(model: nn.Module, tp: int, traced: _Traced) -> Plan:
    plan = Plan(parts=dict(traced.parts))
    styles = dict(traced.styles)
    emb = _module_name(model, model.get_input_embeddings())
    head = _module_name(model, model.get_output_embeddings())
    styles[emb] = "embedding"
    if head is not None:
        styles[head] = "lm_head"
    # parameters the embedding and LM head place (BERT's prediction head owns the LM head's bias too)
    placed = {id(p) for n in (emb, head) if n is not None for p in model.get_submodule(n).parameters(recurse=False)}
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in placed]
        if styles.get(name) is None and own:
            # learned positions make their own position tensors (MVP, XLM): local copies
            styles[name] = "replicate_local" if isinstance(module, nn.Embedding) else "replicate"
    plan.styles = {name: styles[name] for name, _ in model.named_modules() if name in styles}
    for fqn, direction in _hf_directions(model).items():
        ours = "colwise" if plan.styles.get(fqn, "").endswith("colwise") else plan.styles.get(fqn)
        plan.agrees_with_hf[fqn] = ours == direction
    # modules whose forward reshapes sharded activations into heads: parents of colwise layers
    sharded = [n for n, s in plan.styles.items() if s.endswith("colwise") and n not in (emb, head)]
    plan.attention = sorted({n.rsplit(".", 1)[0] for n in sharded})
    _slice_kv_and_unequal_parts(model, plan, tp)
    return plan


def _run_local(model: nn.Module, plan: Plan) -> None:
    """Every ``replicate`` module with nothing split under it becomes ``replicate_local``, with
    everything under it: whole on every rank, it computes on plain tensors and local views of its
    parameters. As replicated DTensors, the tensors a module makes of its own inside (CPM-Ant's
    relative position buckets, a sliding-window mask, an RG-LRU's recurrent state) would meet
    DTensors (``got mixed torch.Tensor and DTensor``), and a norm's output would be a view that
    modeling code cannot modify in place (XLM's ``tensor *= mask``)."""
    kept = ("replicate", "replicate_local")
    for fqn, style in list(plan.styles.items()):
        if style != "replicate":
            continue
        under = [f for f in plan.styles if not fqn or f.startswith(f"{fqn}.")]
        if any(plan.styles[f] not in kept for f in under):
            continue  # something under it is split (or placed otherwise): ``_refuse_unplaceable``
        for f in [fqn, *under]:
            plan.styles[f] = "replicate_local"


def _refuse_unplaceable(model: nn.Module, plan: Plan, traced: _Traced) -> None:
    """What the TP styles cannot place yet, refused before spawning rather than failing in the ranks:

    * a parameter used directly by another module's forward (a mixer calling
      ``conv1d(x, self.conv1d.weight)``): styles act at module boundaries, so it would meet
      plain tensors as a DTensor (where nothing under that module is split, it becomes
      ``replicate_local`` instead: it computes on local copies of its parameters);
    * a ``replicate_grad_allreduce`` module with parameters of its own around split children (a
      ``replicate`` one becomes ``replicate_own``: its parameters act on whole activations only);
    * a parameter shared by modules with different styles (BERT's LM-head bias, also owned by its
      prediction head), other than tied input/output embeddings;
    * an input embedding or LM head with parameters in submodules (Inkling 2's).
    """
    split_all = [f for f, st in plan.styles.items() if st in SPLIT_STYLES]
    for owner, user in traced.foreign.items():
        fqn = owner.split(" (")[0]
        if plan.styles.get(fqn) is None:
            continue
        if user and not any(f == user or f.startswith(f"{user}.") for f in split_all):
            # nothing split under the user (a mixer kept replicated): it runs on local copies
            plan.styles[user] = "replicate_local"
            for name, module in model.get_submodule(user).named_modules():
                if name and any(True for _ in module.parameters(recurse=False)):
                    plan.styles[f"{user}.{name}"] = "replicate_local"
            continue
        who = f"{any_block(user) or 'the model'} ({type(model.get_submodule(user)).__name__})"
        raise ConfigError(
            f"parallel.tp: {who} uses a parameter of "
            f"{any_block(owner)} directly, which tensor-parallel styles cannot place yet; shardlm cannot split "
            "this model with tp > 1 yet, parallel.fsdp trains it"
        )
    split = [f for f, st in plan.styles.items() if st in SPLIT_STYLES]
    for fqn, style in plan.styles.items():
        if style in ("replicate", "replicate_grad_allreduce") and fqn and any(f.startswith(f"{fqn}.") for f in split):
            if style == "replicate":
                # its own parameters act on whole activations only (the trace checked: a parameter,
                # or a tensor computed from parameters alone, meeting split ones is a violation)
                plan.styles[fqn] = "replicate_own"
                continue
            raise ConfigError(
                f"parallel.tp: {any_block(fqn)} ({type(model.get_submodule(fqn)).__name__}) holds parameters of its "
                "own around split layers, which tensor-parallel styles cannot place yet; shardlm cannot split this "
                "model with tp > 1 yet, parallel.fsdp trains it"
            )
        # an input embedding / LM head of several parameterized modules (Inkling 2's): torch's vocabulary
        # styles place only a module's own parameters (found with MoE models, which planned from here on)
        module = model.get_submodule(fqn)
        if style in ("embedding", "lm_head") and any("." in n for n, _ in module.named_parameters()):
            raise ConfigError(
                f"parallel.tp: {fqn} ({type(module).__name__}), the {style.replace('_', ' ')}, holds parameters in "
                "submodules, which the vocabulary-parallel style cannot place yet; shardlm cannot split this model "
                "with tp > 1 yet, parallel.fsdp trains it"
            )
    places: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            places.setdefault(id(p), []).append(name)
    for names in places.values():
        kinds = {plan.styles[n] for n in names if n in plan.styles}  # unstyled: placed by another owner
        if len(kinds) > 1 and kinds != {"embedding", "lm_head"}:
            raise ConfigError(
                f"parallel.tp: a parameter is shared by {' and '.join(names)} with different styles "
                f"({', '.join(sorted(str(k) for k in kinds))}), which shardlm cannot split yet; parallel.fsdp trains it"
            )


def _finish(model: nn.Module, plan: Plan, forced: frozenset[str], reasons: dict[str, str]) -> Plan:
    plan.replicated = {f: reasons.get(f, "") for f in sorted(forced)}
    split = [f for f, s in plan.styles.items() if s in SPLIT_LINEAR or s == "experts"]  # MoE: experts split too
    if forced and not split:
        first = reasons[min(forced)]
        raise ConfigError(
            f"parallel.tp: no layer of {type(model).__name__} can be split: {first}; shardlm cannot split this "
            "model with tp > 1 yet, parallel.fsdp trains it"
        )
    return plan


def _dry_run(model: nn.Module, plan: Plan, tp: int, traced: _Traced) -> tuple[str, str] | None:
    """Run the forward on meta at rank 0's shapes: split linears hold their local rows/columns,
    attention modules their local head counts (``localize_geometry``), as the ranks will.

    Returns ``(module, why)`` for the sub-block that breaks, or None. This catches layouts that a
    global trace cannot see: head counts hard-wired into a reshape (Falcon's multi-query
    ``num_heads + 2``), split sizes of a multi-query fused projection (GPT-BigCode), and fused
    projections grouped by a count the checkpoint fixes (CodeGen's ``mp_num`` groups of
    ``[q, v, k]``: the local reshape still runs, but its groups change size, so it is compared
    with the global trace's)."""
    meta = _build_meta(model, eager=False)
    localize_geometry(meta, plan, tp)
    for fqn, style in plan.styles.items():
        module = meta.get_submodule(fqn)
        conv1d = is_conv1d(module)
        if style in ("colwise", "packed_colwise") and is_linear(module):
            rows = sum(b - a for a, b in plan.sliced[fqn][0]) if fqn in plan.sliced else out_features(module) // tp
            shape = list(module.weight.shape)
            shape[1 if conv1d else 0] = rows
            module.weight = nn.Parameter(torch.empty(shape, device="meta"))
            if module.bias is not None:
                module.bias = nn.Parameter(torch.empty(rows, device="meta"))
            if conv1d:
                module.nf = rows
        elif style == "rowwise" and is_linear(module):
            shape = list(module.weight.shape)
            shape[0 if conv1d else 1] //= tp
            module.weight = nn.Parameter(torch.empty(shape, device="meta"))
        elif style == "sharded_norm":
            module.weight = nn.Parameter(torch.empty(module.weight.shape[0] // tp, device="meta"))
    stack: list[str] = []
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in meta.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        hooks.append(module.register_forward_hook(lambda m, a, o, name=name: _pop(stack, name, o, outputs)))
    tracker = _ShardTracker()
    try:
        with tracker:
            _meta_forward(meta)
    except Exception as exc:  # noqa: BLE001 - a shape error at local shapes: this sub-block cannot be split
        owner = _owner_of_split_linears(plan, stack)
        detail = " ".join(str(exc).split())[:120]
        return owner, f"{owner} ({type(meta.get_submodule(owner)).__name__}) fails at one rank's shapes ({detail})"
    finally:
        for h in hooks:
            h.remove()
    for fqn, global_view in traced.views.items():
        out = outputs.get(fqn)
        if out is None or fqn not in plan.styles or not global_view:
            continue
        local_view = tracker.first_view.get(id(out), ())[out.dim() :]
        if local_view and local_view != global_view:
            owner = fqn.rpartition(".")[0]
            return owner, (
                f"{fqn} ({type(meta.get_submodule(fqn)).__name__}) is fused in groups whose size depends on the "
                f"split (reshaped to {global_view} whole, {local_view} per rank): its layout is fixed by the "
                "checkpoint"
            )
    return None


def _pop(stack: list[str], name: str, out, outputs: dict) -> None:
    if stack and stack[-1] == name:
        stack.pop()
    if isinstance(out, torch.Tensor):
        outputs[name] = out


def _owner_of_split_linears(plan: Plan, stack: list[str]) -> str:
    """The innermost running module that owns split linears (or the parent of a running one)."""
    split = {f for f, s in plan.styles.items() if s in SPLIT_LINEAR}
    parents = {f.rpartition(".")[0] for f in split}
    for name in reversed(stack):
        if name in split:
            return name.rpartition(".")[0]
        if name in parents:
            return name
    return stack[-1] if stack else ""


def _slice_kv_and_unequal_parts(model: nn.Module, plan: Plan, tp: int) -> None:
    """Fill ``plan.sliced`` (see the module docstring); refuse what cannot be split per rank."""
    geo = geometry(model.config)
    heads = geo.get("num_attention_heads", 0)
    kv = geo.get("num_key_value_heads", heads)
    if not heads or not plan.attention:
        return  # nothing split per head (attention-free, or every attention block kept replicated)
    d = min(head_widths(model.config) or {0})
    replicated = kv < tp
    plan.kv_heads = (kv, 1 if replicated else kv // tp)

    def kv_head(rank: int) -> int:  # the kv head rank's query heads read, when kv < tp
        return rank // (tp // kv)

    norms = [f for f, style in plan.styles.items() if style == "sharded_norm"]
    norms = [f for f in norms if model.get_submodule(f).weight.shape[0] == kv * d] or norms  # k_norm first
    if replicated and norms:
        valid = [t for t in _valid_tps(geo) if kv % t == 0]
        raise ConfigError(
            f"parallel.tp={tp} exceeds the model's num_key_value_heads={kv}, and {norms[0]} normalizes across all "
            f"kv heads, which replicated kv heads cannot do; valid tp values: {', '.join(map(str, valid))}"
        )
    for fqn, style in plan.styles.items():
        module, parent = model.get_submodule(fqn), fqn.rpartition(".")[0]
        if style == "colwise" and replicated and parent in plan.attention and out_features(module) == kv * d:
            siblings = [out_features(m) for _, m in model.get_submodule(parent).named_children() if is_linear(m)]
            if heads * d in siblings:
                plan.sliced[fqn] = [[(kv_head(r) * d, (kv_head(r) + 1) * d)] for r in range(tp)]
        elif style == "packed_colwise":
            parts = plan.parts[fqn]
            kv_part = [replicated and p == kv * d and kv != heads for p in parts]
            bad = [p for p, rep in zip(parts, kv_part) if p % tp and not rep]
            if bad:
                raise ConfigError(f"parallel.tp={tp} does not divide the parts {parts} of fused projection {fqn}")
            if len(set(parts)) > 1 or any(kv_part):
                plan.sliced[fqn] = [
                    _packed_rows(parts, kv_part, r, tp, d, kv_head(r) if replicated else 0) for r in range(tp)
                ]
    if replicated:
        owners = {f.rpartition(".")[0] for f in plan.sliced}
        for name in plan.attention:
            module = model.get_submodule(name)
            if name not in owners and any(isinstance(getattr(module, a, None), int) for a in MODULE_KV_COUNT_ATTRS):
                valid = [t for t in _valid_tps(geo) if kv % t == 0]
                raise ConfigError(
                    f"parallel.tp={tp} exceeds the model's num_key_value_heads={kv} and {name} "
                    f"({type(module).__name__}) fuses them in a layout shardlm cannot replicate per rank; "
                    f"valid tp values for this model: {', '.join(map(str, valid))}"
                )


def _packed_rows(parts: list[int], kv_part: list[bool], rank: int, tp: int, d: int, head: int) -> list[tuple[int, int]]:
    """Rank's rows of a packed projection: its chunk of every part, or its kv head's rows."""
    rows, offset = [], 0
    for size, replicated_kv in zip(parts, kv_part):
        if replicated_kv:
            rows.append((offset + head * d, offset + (head + 1) * d))
        else:
            rows.append((offset + rank * size // tp, offset + (rank + 1) * size // tp))
        offset += size
    return rows


def infer_tp_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """``{module_fqn: style}`` for ``model`` at TP degree ``tp`` (empty for tp=1)."""
    return infer_plan(model, tp).styles


def describe_plan(model: nn.Module, plan: Plan, tp: int) -> list[dict]:
    """One row per styled module: style, global and local parameter shapes, fp32 bytes per
    rank, and where the decision came from (cross-checked against the model's own plan or not)."""
    rows, seen = [], {}
    for fqn, style in plan.styles.items():
        module = model.get_submodule(fqn)
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        tied = [seen[id(p)] for _, p in module.named_parameters(recurse=False) if id(p) in seen]
        seen.update({id(p): f"{fqn}.{n}" for n, p in params})
        local = {
            n: local_shape(tuple(p.shape), sharded_dim(style, module, n, plan.experts.get(fqn)), tp) for n, p in params
        }
        source = f"inferred, tied to {tied[0]}" if tied else "inferred"
        if fqn in plan.agrees_with_hf:
            source = "inferred, agrees with HF plan" if plan.agrees_with_hf[fqn] else "inferred, DIFFERS from HF plan"
        if fqn in plan.replicated:
            source += "; its sub-block is kept replicated (listed below)"
        if fqn in plan.experts:  # MoE
            source += f"; {describe_experts(plan.experts[fqn])}"
        if fqn in plan.sliced:
            local = {n: tuple(p.shape) for n, p in params}  # stored whole on every TP rank
            used = sum(b - a for a, b in plan.sliced[fqn][0])
            source += f"; stored replicated, each rank computes {used} of its rows, grads summed over TP"
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _valid_tps(sizes: dict[str, int]) -> list[int]:
    """TP degrees that divide every size, and divide or are a multiple of the kv head count (a
    rank's query heads must read whole kv heads: with fewer kv heads than tp they are replicated)."""
    kv = sizes.get("num_key_value_heads")
    rest = [v for k, v in sizes.items() if k != "num_key_value_heads"] or [kv or 1]
    return [
        t
        for t in range(1, min(rest) + 1)
        if all(s % t == 0 for s in rest) and (kv is None or kv % t == 0 or t % kv == 0)
    ]


def check_config_geometry(config, tp: int) -> None:
    """Refuse a TP degree the model's shapes cannot be split by, naming the numbers."""
    if tp == 1:
        return
    present = geometry(config)
    valid = ", ".join(map(str, _valid_tps(present)))
    for key, size in present.items():
        if size % tp and key != "num_key_value_heads":
            raise ConfigError(
                f"parallel.tp={tp} does not divide the model's {key}={size}; valid tp values for this model: {valid}"
            )
    kv = present.get("num_key_value_heads")
    if kv is not None and kv % tp and tp % kv:
        raise ConfigError(
            f"parallel.tp={tp} neither divides nor is a multiple of the model's num_key_value_heads={kv} (a rank's "
            f"query heads would read parts of two kv heads); valid tp values for this model: {valid}"
        )


def check_geometry(model_path: str, tp: int) -> None:
    """Read ``config.json`` of ``model_path`` and check it against ``tp`` (before spawning)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise ConfigError(f"model: cannot read '{model_path}/config.json': {str(exc).splitlines()[0]}") from None
    check_config_geometry(config, tp)
