"""AutoTP: derive a tensor-parallel plan for a Hugging Face causal LM from its dataflow.

A plan is ``{module_fqn: style}``; the style vocabulary (see ``styles.py``):

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
``replicate`` every other module owning parameters (norms, learned positions)

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
width (OLMo-2's full-width q/k norm): an RMSNorm there becomes ``sharded_norm`` (any other
module is refused). The model's own
``base_model_tp_plan`` is used as a cross-check of the colwise/rowwise directions.

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

import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from shardlm.dropout import dropout_input_shape, dropout_p, is_dropout_call
from shardlm.errors import ConfigError

STYLES = (
    "colwise",
    "rowwise",
    "packed_colwise",
    "embedding",
    "lm_head",
    "replicate_grad_allreduce",
    "sharded_norm",
    "replicate",
)
# torch ops by which a consumer cuts a fused projection's output into parts along the last dim
_SPLIT_OPS = {"split", "chunk", "split_with_sizes", "tensor_split", "unbind"}
# answers for data-dependent questions asked of meta tensors during the trace
_DATA_DEPENDENT = {"item": 0, "__bool__": False, "tolist": []}


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D (GPT-2's transposed linear, weight ``[in, out]``)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def out_features(module: nn.Module) -> int:
    return module.weight.shape[1] if type(module).__name__ == "Conv1D" else module.weight.shape[0]


@dataclass
class Plan:
    """The inferred plan plus what was learned on the way (packed part sizes, attention modules)."""

    styles: dict[str, str] = field(default_factory=dict)
    parts: dict[str, list[int]] = field(default_factory=dict)  # packed_colwise fqn -> part sizes
    attention: list[str] = field(default_factory=list)  # modules holding sharded heads (geometry)
    agrees_with_hf: dict[str, bool] = field(default_factory=dict)  # fqn -> same direction as HF plan
    # fqn -> per TP rank, the (start, stop) output rows it computes; parameters stored replicated
    sliced: dict[str, list[list[tuple[int, int]]]] = field(default_factory=dict)
    kv_heads: tuple[int, int] = (0, 0)  # (global kv heads, kv heads per rank) of attention modules
    # per dropout call site of a forward, in call order (``dropout.py``): the dim along which its
    # input is sharded across TP ranks, None where it is replicated, -1 where sharded on no one dim
    # (or not resolved: p was 0 there when traced, see ``_dropout_dims``)
    dropout_sites: list[int | None] = field(default_factory=list)


class _ShardTracker(TorchFunctionMode):
    """Propagates 'sharded across TP ranks' through every torch op of a meta forward."""

    def __init__(self) -> None:
        super().__init__()
        self.sharded: set[int] = set()
        self.keep: list[torch.Tensor] = []  # keeps traced tensors alive so ids stay unique
        self.first_consumer: dict[int, tuple[str, tuple]] = {}
        self.slices: dict[int, set[int]] = {}
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

    def mark(self, t: torch.Tensor, sharded: bool) -> None:
        self.keep.append(t)
        (self.sharded.add if sharded else self.sharded.discard)(id(t))

    def is_sharded(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.sharded

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _DATA_DEPENDENT and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            # mask helpers ask data questions ("is this a packed sequence?"); meta has no data
            return _DATA_DEPENDENT[name]
        self._record_dropout(func, args, kwargs)
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # every tensor seen stays alive until the trace ends: records are keyed by id(), and a
        # freed tensor's id can be reused (that made packed detection nondeterministic)
        self.keep.extend(inputs)
        self.keep.extend(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        for t in inputs:
            self.first_consumer.setdefault(id(t), (name, args[1:] if args and args[0] is t else args))
        if name == "__getitem__" and args and isinstance(args[0], torch.Tensor):
            self._record_slice(args[0], args[1])
        if any(id(t) in self.sharded for t in inputs):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark(t, True)
        return out

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


def _trace(model: nn.Module, shape: tuple[int, int] = (1, 8)) -> tuple[dict[str, str], dict[str, list[int]], list]:
    """Directions of every linear inside the decoder blocks, packed parts, and the dropout call
    sites (``_ShardTracker.dropout_sites``), from one meta forward of a ``shape`` batch."""
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    config._attn_implementation = "eager"
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    tracker = _ShardTracker()
    styles: dict[str, str] = {}
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    block_prefixes = tuple(f"{name}." for name, m in meta.named_modules() if isinstance(m, nn.ModuleList))

    def pre(name):
        def hook(module, args):
            if not args or not isinstance(args[0], torch.Tensor):
                return
            sharded_in = tracker.is_sharded(args[0])
            if is_linear(module) and name.startswith(block_prefixes):
                styles[name] = "rowwise" if sharded_in else "colwise"
            elif sharded_in and any(True for _ in module.parameters(recurse=False)):
                width = args[0].shape[-1]
                if any(p.shape[-1] == width and p.numel() == width for p in module.parameters(recurse=False)) and (
                    width not in _head_widths(meta.config)
                ):
                    if rms_norm_eps(module) is None:
                        raise ConfigError(
                            f"parallel.tp: {name} ({type(module).__name__}) normalizes across the tensor-parallel "
                            f"width {width}; this model cannot be split with tp > 1 yet, use parallel.fsdp instead"
                        )
                    styles[name] = "sharded_norm"
                    return
                styles[name] = "replicate_grad_allreduce"

        return hook

    def post(name):
        def hook(module, args, out):
            if name in styles and styles[name] in ("colwise", "rowwise"):
                tracker.mark(out, styles[name] == "colwise")
                outputs[name] = out

        return hook

    for name, module in meta.named_modules():
        hooks.append(module.register_forward_pre_hook(pre(name)))
        hooks.append(module.register_forward_hook(post(name)))
    try:
        with tracker:
            meta(input_ids=torch.zeros(shape, dtype=torch.long, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    parts = {}
    for name, style in styles.items():
        if style == "colwise":
            found = _parts_from_consumer(tracker, outputs[name])
            if found and len(found) > 1:
                styles[name], parts[name] = "packed_colwise", found
    return styles, parts, tracker.dropout_sites


def _dropout_dims(model: nn.Module, sites: list[tuple[bool, tuple[int, ...], float]]) -> list[int | None]:
    """The sharded dim of each dropout site's input (see ``Plan.dropout_sites``).

    Shardedness is known per tensor, not per dim, so a second trace with another batch size and
    sequence length tells the batch/sequence dims (their sizes change) from the feature dims
    (they do not); the sharded one is the first feature dim: heads in ``[batch, heads, q, k]``
    attention probabilities, features in ``[batch, seq, ffn]`` or ``[batch*seq, ffn]``. The
    second trace runs only for a model that drops on a sharded tensor (p > 0); other sharded
    sites get -1, which ``dropout.traced_dim`` refuses should one ever draw a mask.
    """
    if not any(sharded and p > 0 for sharded, _, p in sites):
        return [-1 if sharded else None for sharded, _, _ in sites]
    other = _trace(model, (2, 5))[2]
    if len(other) != len(sites):
        raise RuntimeError(f"dropout call sites differ between two traces ({len(sites)} vs {len(other)})")
    dims: list[int | None] = []
    for (sharded, a, _), (_, b, _) in zip(sites, other):
        fixed = [d for d in range(len(a)) if len(a) == len(b) and a[d] == b[d]]
        dims.append((fixed[0] if fixed else -1) if sharded else None)
    return dims


def rms_norm_eps(module: nn.Module) -> float | None:
    """The epsilon of ``module`` if it computes ``weight * x / sqrt(mean(x^2) + eps)`` (in fp32),
    checked by running a CPU copy of it on random numbers; None otherwise (LayerNorm, Gemma's
    ``1 + weight``, anything else) so that only what ``sharded_norm`` reproduces gets it."""
    import copy

    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if [n for n, _ in module.named_parameters(recurse=False)] != ["weight"] or not isinstance(eps, float):
        return None
    probe = copy.deepcopy(module).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=g))
        x = torch.randn(3, probe.weight.shape[0], generator=g)
        want = probe.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return eps if torch.allclose(probe(x), want, rtol=1e-5, atol=1e-6) else None


def _head_widths(config) -> set[int]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {head_dim}


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
    """The full plan for ``model`` (meta or real) at TP degree ``tp``."""
    check_config_geometry(model.config, tp)
    plan = Plan()
    if tp == 1:
        return plan
    styles, plan.parts, sites = _trace(model)
    plan.dropout_sites = _dropout_dims(model, sites)
    emb = _module_name(model, model.get_input_embeddings())
    head = _module_name(model, model.get_output_embeddings())
    styles[emb] = "embedding"
    if head is not None:
        styles[head] = "lm_head"
    for name, module in model.named_modules():
        if name not in styles and any(True for _ in module.parameters(recurse=False)):
            styles[name] = "replicate"
    plan.styles = {name: styles[name] for name, _ in model.named_modules() if name in styles}
    for fqn, direction in _hf_directions(model).items():
        ours = "colwise" if plan.styles.get(fqn, "").endswith("colwise") else plan.styles.get(fqn)
        plan.agrees_with_hf[fqn] = ours == direction
    # modules whose forward reshapes sharded activations into heads: parents of colwise layers
    sharded = [n for n, s in plan.styles.items() if s.endswith("colwise") and n not in (emb, head)]
    plan.attention = sorted({n.rsplit(".", 1)[0] for n in sharded})
    _slice_kv_and_unequal_parts(model, plan, tp)
    return plan


def _slice_kv_and_unequal_parts(model: nn.Module, plan: Plan, tp: int) -> None:
    """Fill ``plan.sliced`` (see the module docstring); refuse what cannot be split per rank."""
    geo = _geometry(model.config)
    heads = geo.get("num_attention_heads", 0)
    kv = geo.get("num_key_value_heads", heads)
    d = next(iter(_head_widths(model.config)))
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
            if name not in owners and any(isinstance(getattr(module, a, None), int) for a in _KV_COUNT_ATTRS):
                valid = [t for t in _valid_tps(geo) if kv % t == 0]
                raise ConfigError(
                    f"parallel.tp={tp} exceeds the model's num_key_value_heads={kv} and {name} "
                    f"({type(module).__name__}) fuses them in a layout shardlm cannot replicate per rank; "
                    f"valid tp values for this model: {', '.join(map(str, valid))}"
                )


_KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads", "num_key_value_groups")


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


def _local_shape(shape: tuple[int, ...], name: str, style: str, conv1d: bool, tp: int) -> tuple[int, ...]:
    """Shape of one rank's piece of a parameter of a module with ``style``."""
    dim = None
    if style in ("colwise", "packed_colwise", "lm_head", "embedding", "sharded_norm"):
        dim = 0 if name != "weight" or not conv1d else 1
    elif style == "rowwise" and name == "weight":
        dim = 0 if conv1d else 1
    if dim is None or len(shape) <= dim:
        return shape
    return tuple(s // tp if i == dim else s for i, s in enumerate(shape))


def describe_plan(model: nn.Module, plan: Plan, tp: int) -> list[dict]:
    """One row per styled module: style, global and local parameter shapes, fp32 bytes per
    rank, and where the decision came from (cross-checked against the model's own plan or not)."""
    rows, seen = [], {}
    for fqn, style in plan.styles.items():
        module = model.get_submodule(fqn)
        conv1d = type(module).__name__ == "Conv1D"
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        tied = [seen[id(p)] for _, p in module.named_parameters(recurse=False) if id(p) in seen]
        seen.update({id(p): f"{fqn}.{n}" for n, p in params})
        local = {n: _local_shape(tuple(p.shape), n, style, conv1d, tp) for n, p in params}
        source = f"inferred, tied to {tied[0]}" if tied else "inferred"
        if fqn in plan.agrees_with_hf:
            source = "inferred, agrees with HF plan" if plan.agrees_with_hf[fqn] else "inferred, DIFFERS from HF plan"
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
    rest = [v for k, v in sizes.items() if k != "num_key_value_heads"] or [kv]
    return [
        t
        for t in range(1, min(rest) + 1)
        if all(s % t == 0 for s in rest) and (kv is None or kv % t == 0 or t % kv == 0)
    ]


def _geometry(config) -> dict[str, int]:
    """Sizes that TP must divide, read under the names different families use."""
    aliases = {
        "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
        "num_key_value_heads": ("num_key_value_heads", "num_kv_heads"),
        "vocab_size": ("vocab_size",),
        "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    }
    found = {}
    for key, names in aliases.items():
        for n in names:
            v = getattr(config, n, None)
            if isinstance(v, int) and v > 0:
                found[key] = v
                break
    return found


def check_config_geometry(config, tp: int) -> None:
    """Refuse a TP degree the model's shapes cannot be split by, naming the numbers."""
    if tp == 1:
        return
    present = _geometry(config)
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
