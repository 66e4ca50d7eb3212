"""Style names -> DTensor ``ParallelStyle`` objects, plus the local head geometry they need.

``colwise``/``rowwise``/``embedding``/``lm_head`` are torch's own styles; for GPT-2's
``Conv1D`` (weight stored ``[in, out]``) the same styles shard the transposed dimension, so
checkpoints keep their HF layout. Three styles are ours:

* ``replicate``: a module (a norm) whose parameters must be DTensors on the TP mesh while the
  activations through it are plain tensors: inputs enter as replicated DTensors and leave
  local, so its gradients are replicated DTensors like everything else. Plans now give
  ``replicate_local`` (``LocalReplicate``: the module computes on plain tensors and local views
  of its parameters, so tensors it makes of its own never meet DTensors) to every such module
  with nothing split under it, and ``replicate_own`` (its own parameters only) to one around
  split children.
* ``replicate_grad_allreduce``: the same, for a module applied per head to a *sharded*
  activation (Qwen3's q_norm/k_norm): each rank's gradient covers only its heads, so the
  trainer sums these gradients over the TP group (``sum_tp_partial_grads``).
* ``packed_colwise``: a fused projection of parts (GPT-2 c_attn, Phi-3 gate_up, Qwen3.5's
  q|k|v of key, key and value widths) is sharded part by part (``shards.packed_placement``:
  ``_StridedShard(dim, split_factor=P)`` for P equal parts, ``PartsShard`` for unequal ones):
  rank r holds rows ``[q_r; k_r; v_r]``, whole heads of every part, while the DTensor's global
  view stays in HF order (consolidation and resharding need no permutation). The matmul runs on
  local tensors.
* ``SlicedColwise`` (the plan's ``sliced`` entries: k/v with fewer kv heads than tp, packed
  projections with a part every rank needs whole or a replicated kv head): parameters replicated
  on the TP mesh, each rank multiplies only its rows; their gradients are summed over TP like
  ``replicate_grad_allreduce``. The input's gradient joins the sibling colwise layers' partial
  sum (one all-reduce per sub-block).

* ``ExpertsParallel`` (``experts``, mixture-of-experts layers): fused 3-D expert parameters,
  each expert's intermediate dim sharded (``Plan.experts``: per parameter, derived by
  ``parallel/experts.py``); the module's own forward, whatever experts kernel is active, runs on
  the local pieces and its output, a partial sum, is all-reduced once; in backward the gradients of
  its replicated inputs (hidden states, routing weights) are summed over TP in one all-reduce.

After TP, attention modules that read head counts from attributes (``self.num_heads``,
``self.split_size``, ``self.config.num_attention_heads``) get those set to the local values.
"""

from __future__ import annotations

import copy
import functools
import types
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardlm.distributed.shards import LocalParams, packed_placement, parameter
from shardlm.parallel.channels import PerChannel, channel_partial_grads, local_views
from shardlm.parallel.hf import (
    MODULE_HEAD_ATTRS,
    MODULE_KV_ATTRS,
    config_size,
    config_value,
    is_conv1d,
    rms_norm_eps,
)
from shardlm.parallel.plan import Plan
from shardlm.parallel.styles import ExpertParam, Style


def shard_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, object], src: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, parameter(param, mesh, placements[name], src))


class _Conv1DAware:
    """Mixin: run torch's Linear partitioning on Conv1D with the weight's dims swapped."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        colwise = isinstance(self, ColwiseParallel)
        if not colwise:
            self.desired_input_layouts = (Shard(-1),)  # what RowwiseParallel sets for nn.Linear
        placements = {"weight": Shard(1) if colwise else Shard(0), "bias": Shard(0) if colwise else Replicate()}
        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: shard_params(mod, mesh, placements, self.src_data_rank),
            lambda mod, inputs, mesh: self._prepare_input_fn(
                self.input_layouts, self.desired_input_layouts, mod, inputs, mesh
            ),
            lambda mod, outputs, mesh: self._prepare_output_fn(
                self.output_layouts, self.use_local_output, mod, outputs, mesh
            ),
        )


class Colwise(_Conv1DAware, ColwiseParallel):
    """ColwiseParallel whose sibling layers share one DTensor view of their common input.

    q/k/v (and gate/up) read the same activation. Converted separately, each backward would
    all-reduce its own partial input gradient (5 all-reduces per Llama block); converted once,
    the partial gradients add up locally and one all-reduce per sub-block remains (Megatron's
    minimum).
    """

    _last: tuple = (None, None, None)  # (weakref to the plain input, mesh, its DTensor view)

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if isinstance(x, DTensor) or input_layouts != (Replicate(),):
            return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        return replicated_view(x, device_mesh)


def replicated_view(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """One replicated DTensor view per (activation, mesh), shared by every column-parallel reader
    of ``x`` (``Colwise``, LoRA layers): their partial input gradients add up on the view, and
    its backward all-reduces them once."""
    ref, last_mesh, view = Colwise._last
    if ref is None or ref() is not x or last_mesh is not mesh:
        view = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        Colwise._last = (weakref.ref(x), mesh, view)
    return view


class Rowwise(_Conv1DAware, RowwiseParallel):
    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        # to_local() returns a view made inside an autograd Function; models that add into it
        # in place (Falcon's ``mlp_output += attention_output``) need a tensor of their own
        return out.clone() if use_local_output else out


class SummedRowwise(Rowwise):
    """``rowwise`` whose whole output is read back inside the split region (Mamba's ``x_proj``:
    ``parallel/summed.py``): each rank's gradient of it covers its own channels only, so the backward
    of the output's all-reduce is an all-reduce of that gradient."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = Rowwise._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        whole = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
        return whole.to_local(grad_placements=[Partial()])


class ReplicateParallel(ParallelStyle):
    """Parameters replicated on the TP mesh; inputs enter as replicated DTensors, outputs leave local."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        shard_params(
            module, mesh, {n: Replicate() for n, _ in module.named_parameters(recurse=False)}, self.src_data_rank
        )

    @staticmethod
    def _wrap(x, mesh: DeviceMesh):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x

    @staticmethod
    def _unwrap_outputs(module: nn.Module, outputs, mesh: DeviceMesh):
        if isinstance(outputs, DTensor) and isinstance(module, nn.Embedding):
            return outputs.to_local().clone()  # learned positions are added to in place (XLM)
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # inputs may come as keyword arguments (OPT's positions): wrap those too
        def wrap_inputs(mod, args, kwargs):
            args = tuple(self._wrap(a, device_mesh) for a in args)
            return args, {k: self._wrap(v, device_mesh) for k, v in kwargs.items()}

        distribute_module(module, device_mesh, self._partition, None, self._unwrap_outputs)
        module.register_forward_pre_hook(wrap_inputs, with_kwargs=True)
        return module


def column_input(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` (replicated) for a layer computing on local column shards: the same values, but its
    gradient, which covers only this rank's output columns, is summed over TP on the way back."""
    return replicated_view(x, mesh).to_local(grad_placements=[Partial()])


def local_linear(module: nn.Module, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
    """Linear/Conv1D on the local pieces of the module's (DTensor) weight and bias."""
    weight = module.weight.to_local()
    bias = module.bias.to_local() if with_bias and module.bias is not None else None
    if is_conv1d(module):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
        return out.view(*x.shape[:-1], weight.shape[1])
    return nn.functional.linear(x, weight, bias)


def _local_linear_forward(module: nn.Module, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    """Linear/Conv1D on the local shards of packed parameters (rank r's rows of every part).

    ``mesh``: the style's TP mesh, the object the sibling column-parallel layers key their shared
    view of ``x`` by (``replicated_view``); the weight's ``device_mesh`` is an equal but distinct
    object, with which this layer's input gradient was all-reduced on its own (Qwen3.5's
    ``in_proj_qkv`` beside ``in_proj_z/b/a``: one all-reduce more per mixer backward)."""
    return local_linear(module, column_input(x, mesh))


class PackedColwiseParallel(ParallelStyle):
    """Fused projection of ``parts`` (their sizes), each sharded on its own (see module docstring)."""

    def __init__(self, parts: list[int]):
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        out_dim = 1 if is_conv1d(module) else 0
        placements = {"weight": packed_placement(out_dim, self.parts), "bias": packed_placement(0, self.parts)}
        shard_params(module, device_mesh, placements, self.src_data_rank)
        module.forward = functools.partial(_local_linear_forward, module, device_mesh)
        return module


def _sliced_linear_forward(
    module: nn.Module, rows: list[tuple[int, int]], mesh: DeviceMesh, x: torch.Tensor
) -> torch.Tensor:
    """Linear on this rank's ``rows`` of replicated parameters (bound by ``SlicedColwise``).

    The input's gradient from this rank covers only these rows: declared Partial on the shared
    view of ``x``, it is summed once over TP together with the sibling colwise layers'
    (``mesh`` is the object sibling Colwise layers see: their shared view's key).
    """
    return sliced_linear(module, column_input(x, mesh), rows)


def take_rows(t: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """Rows ``[a, b)`` of each range of ``rows``, concatenated (a view when there is one range)."""
    return torch.cat([t[a:b] for a, b in rows]) if len(rows) > 1 else t[rows[0][0] : rows[0][1]]


def sliced_linear(module: nn.Module, x: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """Linear on ``rows`` of the module's replicated (DTensor) weight and bias."""
    bias = take_rows(module.bias.to_local(), rows) if module.bias is not None else None
    return nn.functional.linear(x, take_rows(module.weight.to_local(), rows), bias)


class SlicedColwise(ParallelStyle):
    """Replicated nn.Linear whose forward computes only this rank's output rows (see module docstring)."""

    def __init__(self, rows: list[list[tuple[int, int]]]):
        super().__init__()
        self.rows = rows

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"sliced colwise needs nn.Linear, got {type(module).__name__}")
        shard_params(
            module, device_mesh, {n: Replicate() for n, _ in module.named_parameters(recurse=False)}, self.src_data_rank
        )
        rows = self.rows[device_mesh.get_local_rank()]
        module.forward = functools.partial(_sliced_linear_forward, module, rows, device_mesh)
        return module


class LatentColwise(ParallelStyle):
    """``colwise`` reading a low-rank latent kept whole (MLA's ``q_b_proj``, ``kv_b_proj``;
    ``parallel/latent.py``): sharded by output features, computing on its input as it is, whose
    gradient from this rank's heads stays partial: it is summed over TP at the latent's input."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim = 1 if is_conv1d(module) else 0
        shard_params(module, device_mesh, {"weight": Shard(dim), "bias": Shard(0)}, self.src_data_rank)
        module.forward = types.MethodType(local_linear, module)
        return module


class LocalReplicate(ParallelStyle):
    """``replicate_local``: parameters replicated on the TP mesh (DTensors, like ``replicate``), but
    while the module runs, it and its submodules see local views of them, so code that uses a
    child's parameter directly (``conv1d(x, self.conv1d.weight)``) or makes plain tensors of its
    own computes on plain tensors throughout. Every rank computes the same values; the views'
    gradients arrive as replicated gradients of the parameters (swapped by ``LocalParams``)."""

    def __init__(self, own_only: bool = False):
        super().__init__()
        self.own_only = own_only  # ``replicate_own``: split children place their own parameters

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_params(
            module, device_mesh, {n: Replicate() for n, _ in module.named_parameters(recurse=False)}, self.src_data_rank
        )
        params = LocalParams()

        def to_local(mod, args):
            for sub in [mod] if self.own_only else mod.modules():
                for name, param in list(sub._parameters.items()):
                    if isinstance(param, DTensor):
                        params.swap(sub, name, param.to_local(grad_placements=[Replicate()]))

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(lambda mod, args, out: params.restore())
        return module


class ShardedRMSNorm(ParallelStyle):
    """RMSNorm across a sharded width (OLMo-2's q_norm/k_norm after column-parallel q/k): the
    weight is sharded like the activation; each rank sums the squares of its slice and one
    all-reduce of that ``[tokens, 1]`` sum gives the full width's mean (in the backward, the
    gradients of the sum are all-reduced the same way). No activation is gathered. The formula
    is checked against the module's own forward when the plan is made (``hf.rms_norm_eps``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        eps, width = rms_norm_eps(module), module.weight.shape[0]
        shard_params(module, device_mesh, {"weight": Shard(0)}, self.src_data_rank)

        def forward(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
            h = x.float()
            if gate is not None:  # Mamba-2's gated norm: gated first (``hf.gates_before_norm``)
                h = h * F.silu(gate.float())
            squares = DTensor.from_local(h.pow(2).sum(-1, keepdim=True), device_mesh, [Partial()], run_check=False)
            total = squares.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            return (module.weight.to_local() * (h * torch.rsqrt(total / width + eps))).to(x.dtype)

        module.forward = forward
        return module


def _all_reduce(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum over TP of ``t`` (outside autograd: in a backward)."""
    return DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class SumGradsOverTP(torch.autograd.Function):
    """Identity forward; backward: the gradients of all its inputs summed over TP in one all-reduce
    (flattened together, in the widest of their dtypes)."""

    @staticmethod
    def forward(ctx, mesh: DeviceMesh, *tensors: torch.Tensor):
        ctx.mesh = mesh
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        present = [g for g in grads if g is not None]
        if not present:
            return (None, *grads)
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in present))
        flat = _all_reduce(torch.cat([g.reshape(-1).to(dtype) for g in present]), ctx.mesh)
        out, offset = [], 0
        for g in grads:
            if g is None:
                out.append(None)
                continue
            out.append(flat[offset : offset + g.numel()].view(g.shape).to(g.dtype))
            offset += g.numel()
        return (None, *out)


def expert_placements(module: nn.Module, params: dict[str, ExpertParam]) -> dict[str, object]:
    """The TP placement of each parameter of an experts module (``styles.ExpertParam``)."""
    whole = ExpertParam(None)
    return {name: params.get(name, whole).placement(p.shape) for name, p in module.named_parameters(recurse=False)}


class ExpertsParallel(ParallelStyle):
    """``experts``: a mixture-of-experts module of fused 3-D parameters, each expert's intermediate
    dim sharded (see the module docstring and ``parallel/experts.py``).

    While the module runs, its own parameters are local pieces (the hidden states and routing
    weights it reads are plain replicated tensors), so any experts kernel computes this rank's
    share of every expert: a partial sum of the output, all-reduced on the way out. A parameter
    placed ``once`` (a bias after the down projection) is whole on every rank but used by rank 0
    only (others see zeros): its gradient is summed over TP with the other TP-partial gradients
    (``tp_partial_grad_params``). The gradients of the floating-point inputs are summed over TP
    in one all-reduce (``SumGradsOverTP``): each rank's covers only its share of the experts.
    The swap is ``LocalParams``'s.
    """

    def __init__(self, params: dict[str, ExpertParam]):
        super().__init__()
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_params(module, device_mesh, expert_placements(module, self.params), self.src_data_rank)
        muted = device_mesh.get_local_rank() != 0
        once = {name for name, p in self.params.items() if p.once}
        params = LocalParams()

        def to_local(mod, args, kwargs):
            for name, param in list(mod._parameters.items()):
                if isinstance(param, DTensor):
                    local = param.to_local()
                    params.swap(mod, name, local * 0 if muted and name in once else local)
            flat, spec = tree_flatten((args, kwargs))
            floats = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if floats:
                summed = SumGradsOverTP.apply(device_mesh, *(flat[i] for i in floats))
                for i, t in zip(floats, summed):
                    flat[i] = t
            return tree_unflatten(flat, spec)

        def restore(mod, args, out):
            params.restore()
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"{type(mod).__name__} returned {type(out).__name__}, not one tensor")
            # a tensor of its own (Rowwise's reason: models add into the output in place)
            reduced = DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
            return reduced.redistribute(device_mesh, [Replicate()]).to_local().clone()

        module.register_forward_pre_hook(to_local, with_kwargs=True)
        module.register_forward_hook(restore)
        return module


def make_style(
    style: str,
    parts: list[int] | None = None,
    rows: list | None = None,
    experts: dict[str, ExpertParam] | None = None,
    views: dict | None = None,
    latent_input: bool = False,
    summed: bool = False,
) -> ParallelStyle:
    """The torch style for one word of the plan vocabulary (``styles.Style``; what each shards:
    ``styles.PLACEMENTS``); ``rows``: the plan's ``sliced`` entry (replicated parameters, per-rank
    output rows); ``experts``: the plan's ``experts`` entry of an experts or ``per_channel``
    module; ``views``: a ``per_channel`` module's ``channels.local_views``; ``latent_input``: a
    ``colwise`` layer reads a low-rank latent kept whole (``Plan.latent_readers``); ``summed``: a
    ``rowwise`` layer's output gradient is summed over TP (``Plan.summed``)."""
    if rows is not None:
        return SlicedColwise(rows)
    match Style(style):
        case Style.COLWISE:
            return LatentColwise() if latent_input else Colwise()
        case Style.ROWWISE:
            return SummedRowwise() if summed else Rowwise()
        case Style.PACKED_COLWISE:
            return PackedColwiseParallel(parts)
        case Style.EMBEDDING:
            # vocab rows sharded; each rank looks up its rows, the partial sums are all-reduced (Rowwise:
            # a tensor of its own, as models scale the embeddings in place: CTRL's ``*= sqrt(d)``)
            return Rowwise(input_layouts=Replicate())
        case Style.LM_HEAD:
            # logits stay sharded over the vocabulary: the loss runs under loss_parallel
            return Colwise(output_layouts=Shard(-1), use_local_output=False)
        case Style.REPLICATE | Style.REPLICATE_GRAD_ALLREDUCE:
            return ReplicateParallel()
        case Style.REPLICATE_LOCAL:
            return LocalReplicate()
        case Style.REPLICATE_OWN:
            return LocalReplicate(own_only=True)
        case Style.SHARDED_NORM:
            return ShardedRMSNorm()
        case Style.EXPERTS:
            return ExpertsParallel(experts or {})
        case Style.PER_CHANNEL:
            return PerChannel(experts or {}, views or {})


def plan_styles(plan: Plan) -> dict[str, ParallelStyle]:
    """The torch style of every module of ``plan``."""
    return {
        fqn: make_style(
            s,
            plan.parts.get(fqn),
            plan.sliced.get(fqn),
            plan.experts.get(fqn),
            local_views(plan, fqn),
            fqn in plan.latent_readers,
            fqn in plan.summed,
        )
        for fqn, s in plan.styles.items()
    }


_WIDTH_ATTRS = ("split_size", "hidden_size", "embed_dim", "all_head_size", "head_size_total")


def localize_geometry(model: nn.Module, plan: Plan, tp: int) -> None:
    """Set head counts and head-concatenation widths of attention modules to their local values.

    Only modules that own a head-count attribute and hold column-parallel children are touched;
    a module reading ``self.config`` for head counts gets its own localized copy of the config.
    """
    for name, sizes in plan.local_sizes.items():  # a mixer's widths (``channels.local_sizes``)
        for attr, value in sizes.items():
            setattr(model.get_submodule(name), attr, value)
    config = model.config
    heads = config_size(config, "num_attention_heads")
    if heads is None or not plan.attention:
        return  # attention-free, or every attention block kept replicated
    kv = config_size(config, "num_key_value_heads") or heads
    head_dim = config_value(config, "head_dim") or config.hidden_size // heads
    local_kv = plan.kv_heads[1] or kv // tp  # 1 when kv heads are replicated (fewer than tp)
    for name in plan.attention:
        module = model.get_submodule(name)
        if isinstance(getattr(module, "num_key_value_groups", None), int):
            # query heads per kv head on this rank: 1 where kv heads are replicated (eager attention
            # repeats k/v by it; sdpa packs by it)
            module.num_key_value_groups = max(1, (heads // tp) // local_kv)
        if not any(isinstance(getattr(module, a, None), int) for a in MODULE_HEAD_ATTRS + MODULE_KV_ATTRS):
            continue
        for attr in MODULE_HEAD_ATTRS + MODULE_KV_ATTRS + _WIDTH_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, bool) or not isinstance(value, int) or attr in plan.local_sizes.get(name, {}):
                continue  # a mixer's head count (Mamba-2's num_heads) is set by its local sizes above
            if (attr in MODULE_HEAD_ATTRS and value == heads) or (attr in _WIDTH_ATTRS and value == heads * head_dim):
                setattr(module, attr, value // tp)
            elif attr in MODULE_KV_ATTRS and value == kv:
                setattr(module, attr, local_kv)
        if getattr(module, "config", None) is config:
            local = copy.copy(config)
            for attr in ("num_attention_heads", "n_head", "num_key_value_heads", "num_kv_heads"):
                if isinstance(getattr(config, attr, None), int):
                    value = getattr(config, attr)
                    setattr(local, attr, local_kv if attr in MODULE_KV_ATTRS and value == kv else value // tp)
            module.config = local


def tp_partial_grad_params(model: nn.Module, plan: Plan) -> list[str]:
    """FQNs of parameters whose gradients must be summed over TP (``replicate_grad_allreduce``,
    the replicated parameters of sliced projections and of ``per_channel`` modules following
    them, and experts' parameters added ``once``)."""
    return channel_partial_grads(model, plan) + [
        f"{fqn}.{pname}"
        for fqn, style in plan.styles.items()
        for pname, _ in model.get_submodule(fqn).named_parameters(recurse=False)
        if style == Style.REPLICATE_GRAD_ALLREDUCE
        or fqn in plan.sliced
        or (style == Style.EXPERTS and getattr(plan.experts.get(fqn, {}).get(pname), "once", False))
    ]


@torch.no_grad()
def sum_tp_partial_grads(model: nn.Module, names: list[str], tp_group: dist.ProcessGroup) -> None:
    """All-reduce over TP the gradients that each rank computed from its own heads only: one
    all-reduce per dtype over the flattened gradients (they are small: norms, kv projections)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for name in names:
        grad = model.get_parameter(name).grad
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_dtype.setdefault(local.dtype, []).append(local)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
