"""The linear styles (``Colwise``, ``Rowwise``, packed, sliced, latent), and how every style
word of the plan becomes a ``ParallelStyle`` (``plan_styles.py`` maps them; ``embedding.py``,
``replicate.py``, ``experts.py``, ``channels.py`` hold the others; ``grads.py`` the TP-partial gradient sums).

``colwise``/``rowwise``/``lm_head`` compute on local tensors, as Megatron-LM's ``tensor_parallel``
layers do: the parameters are DTensors (``Shard`` on the TP mesh, what FSDP2, clipping and checkpoints
need), the forward and backward run on their ``to_local()`` pieces with the collectives of
``regions.py`` (the same ones torch's ``ColwiseParallel``/``RowwiseParallel`` issue through DTensor's
dispatch, which cost a sixth of a tp=2 step in Python on the bench model: ``benchmarks/README.md``).
For GPT-2's ``Conv1D`` (weight stored ``[in, out]``) the same styles shard the transposed dimension, so
checkpoints keep their HF layout. More styles:

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
* ``colwise`` of the plan's ``stored_rows`` entries (Zaya's value of two projections viewed into heads):
  ``Colwise`` whose weight and bias are ``RowsShard``, each rank storing the rows it computes (all of
  one linear, part of it, or none).
* ``SlicedColwise`` (the plan's ``sliced`` entries: k/v with fewer kv heads than tp, packed
  projections with a part every rank needs whole or a replicated kv head): parameters replicated
  on the TP mesh, each rank multiplies only its rows; their gradients are summed over TP like
  ``replicate_grad_allreduce``. The input's gradient joins the sibling colwise layers' partial
  sum (one all-reduce per sub-block).

* ``ExpertsParallel`` (``experts``, mixture-of-experts layers): fused 3-D expert parameters,
  each expert's intermediate dim sharded (``Plan.experts``: per parameter, derived by
  ``parallel/infer/experts.py``); the module's own forward, whatever experts kernel is active, runs on
  the local pieces and its output, a partial sum, is all-reduced once; in backward the gradients of
  its replicated inputs (hidden states, routing weights) are summed over TP in one all-reduce.

After TP, attention modules that read head counts from attributes (``self.num_heads``,
``self.split_size``, ``self.config.num_attention_heads``) get those set to the local values
(``plan/local_geometry.py``).
"""

from __future__ import annotations

import functools
import types
import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from shardlm.distributed.shards import LocalParams, RowsShard, local_view, packed_placement, parameter
from shardlm.parallel.model.hf import extra_params, is_conv1d
from shardlm.parallel.runtime.regions import (
    copy_to_region,
    gather_to_column_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
)


def shard_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, object], src: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, parameter(param, mesh, placements[name], src))


class _SharedInput:
    """The one region input shared by the column-parallel readers of one activation (``column_input``), and
    under sequence parallelism the gathered sequence they read (``gathered_input``): Python state kept
    between the readers' calls, keyed by the activation's identity and the TP mesh object."""

    last: tuple = (None, None, None)  # (weakref to the activation, mesh, what its readers read)
    # sequence parallelism: (weakref to the sequence slice, mesh, the whole sequence)
    gathered: tuple = (None, None, None)


@torch.compiler.disable
def column_input(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` (replicated) for layers computing on local column shards: the same values, but its gradient,
    which covers only their output columns, is summed over TP on the way back (``copy_to_region``,
    Megatron's "f"). One per (activation, mesh), shared by every column-parallel reader of ``x``
    (``Colwise``, packed, sliced, LoRA layers): q/k/v (gate/up) add their partial input gradients up
    locally, and one all-reduce per sub-block remains (Megatron's minimum; torch's ``ColwiseParallel``
    per layer would all-reduce each: 5 per Llama block).

    Kept out of ``train.compile``'s graphs (``train/compile.py``): the cached input is Python state
    between calls that a graph cannot carry."""
    ref, last_mesh, shared = _SharedInput.last
    if ref is None or ref() is not x or last_mesh is not mesh:
        shared = copy_to_region(x, mesh)
        _SharedInput.last = (weakref.ref(x), mesh, shared)
    return shared


def gathered_input(chunk: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Under sequence parallelism, the whole sequence of ``chunk`` (this rank's slice) for a sub-block
    of column-parallel readers (``runtime/sequence.py``): one all-gather per activation, shared by the
    sub-blocks reading the same one (a parallel residual's one norm output). Its readers read it as it
    is (``column_input`` gives it back): their gradients, partial sums, add up on it and its backward
    reduce-scatters them over TP once."""
    ref, last_mesh, full = _SharedInput.gathered
    if ref is None or ref() is not chunk or last_mesh is not mesh:
        full = gather_to_column_region(chunk, mesh).to_local(grad_placements=[Partial()])
        _SharedInput.gathered = (weakref.ref(chunk), mesh, full)
    _SharedInput.last = (weakref.ref(full), mesh, full)
    return full


class Colwise(ParallelStyle):
    """``colwise`` (and, ``sharded_output``, ``lm_head``): Linear/Conv1D sharded by output features,
    computed on local tensors (Megatron's ``ColumnParallelLinear``): the replicated input enters the
    region shared with its column-parallel siblings (``column_input``).
    The output is this rank's columns, a plain tensor; the LM head's is wrapped as a ``Shard(-1)``
    DTensor (its loss: ``cross_entropy.py``). Parameters stay DTensors (FSDP, clipping, checkpoints).
    ``rows``: the plan's ``stored_rows`` entry, each rank's output rows where they are not its chunk
    (``shards.RowsShard``: Zaya's value projections); computed the same way, on what the rank holds."""

    def __init__(self, sharded_output: bool = False, rows: list[list[tuple[int, int]]] | None = None):
        super().__init__()
        self.sharded_output, self.rows = sharded_output, rows

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim = 1 if is_conv1d(module) else 0
        # an LM head's own per-token parameters (Dory's ``logit_scale``), by vocabulary rows too
        # (``infer/vocab_head.py`` checked that each acts on its own columns)
        own = {n: Shard(0) for n in extra_params(module)}
        own = own if self.sharded_output else {}  # a colwise layer with more than weight/bias: not placed
        weight, bias = (
            (Shard(dim), Shard(0)) if self.rows is None else (RowsShard(dim, self.rows), RowsShard(0, self.rows))
        )
        shard_params(module, device_mesh, {"weight": weight, "bias": bias, **own}, self.src_data_rank)
        if own:
            module.forward = functools.partial(_own_head_forward, module, device_mesh, type(module).forward)
        else:
            module.forward = functools.partial(_colwise_forward, module, device_mesh, self.sharded_output)
        return module


def _colwise_forward(module: nn.Module, mesh: DeviceMesh, sharded_output: bool, x: torch.Tensor) -> torch.Tensor:
    out = local_linear(module, column_input(x, mesh))
    return sharded_logits(out, module.weight.shape[1 if is_conv1d(module) else 0], mesh) if sharded_output else out


def _own_head_forward(module: nn.Module, mesh: DeviceMesh, forward, x: torch.Tensor) -> DTensor:
    """An LM head's own forward (Dory's ``logits * logit_scale``) on the local pieces of its parameters:
    this rank's vocabulary columns of the logits, kept split like ``_colwise_forward``'s."""
    params = LocalParams()
    for name, param in list(module._parameters.items()):
        if isinstance(param, DTensor):
            params.swap(module, name, local_view(param))
    try:
        out = forward(module, column_input(x, mesh))
    finally:
        params.restore()
    return sharded_logits(out, module.weight.shape[0], mesh)


def sharded_logits(local: torch.Tensor, vocab: int, mesh: DeviceMesh) -> DTensor:
    """The LM head's local logits as the ``Shard(-1)`` DTensor of ``vocab`` columns. The global size is
    given, not inferred (``from_local`` takes it as local x tp): with a vocabulary tp does not divide
    (GPT-2's 50257) torch's chunks leave the last rank fewer columns, and the loss finds each rank's first
    vocabulary row from the global size (``cross_entropy._vocab_start``)."""
    shape = (*local.shape[:-1], vocab)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    return DTensor.from_local(local, mesh, [Shard(-1)], run_check=False, shape=torch.Size(shape), stride=tuple(stride))


class Rowwise(ParallelStyle):
    """``rowwise``: Linear/Conv1D sharded by input features, computed on local tensors (Megatron's
    ``RowParallelLinear``): the local matmul's partial sum is all-reduced (``reduce_from_region``), then the
    replicated bias is added once. ``output``: ``"scattered"`` under sequence parallelism, the partial sum
    reduce-scattered to this rank's slice of the sequence (``reduce_scatter_to_sequence_region``);
    ``"summed"`` for a layer whose whole output is read back inside the split region (Mamba's ``x_proj``:
    ``parallel/infer/summed.py``): each rank's gradient of it covers its own channels only, so the backward
    of the output's all-reduce is an all-reduce of that gradient (``copy_to_region``); ``"narrowed"``, the same,
    then this rank's chunk of its columns (one value per head: Doge's ``dt_proj``). The output is a
    tensor of its own: models add into it in place (Falcon's ``mlp_output += attention_output``)."""

    def __init__(self, output: str = "reduced"):
        super().__init__()
        self.output = output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim = 0 if is_conv1d(module) else 1
        shard_params(module, device_mesh, {"weight": Shard(dim), "bias": Replicate()}, self.src_data_rank)
        module.forward = functools.partial(_rowwise_forward, module, device_mesh, self.output)
        return module


def _rowwise_forward(module: nn.Module, mesh: DeviceMesh, output: str, x: torch.Tensor) -> torch.Tensor:
    partial = local_linear(module, x.to_local() if isinstance(x, DTensor) else x, with_bias=False)
    if output == "scattered":
        out = reduce_scatter_to_sequence_region(partial, mesh)
    else:
        out = reduce_from_region(partial, mesh)
    if module.bias is not None:
        out = out + local_view(module.bias)
    elif output == "scattered":
        out = out.clone()  # a view made inside DTensor's redistribute (see the class docstring)
    if output == "narrowed":  # this rank's columns, one per head (``infer/narrowed.py``); their gradients summed
        width = out.shape[-1] // mesh.size()
        return copy_to_region(out, mesh).narrow(-1, mesh.get_local_rank() * width, width)
    return copy_to_region(out, mesh) if output == "summed" else out


def local_linear(module: nn.Module, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
    """Linear/Conv1D on the local pieces of the module's (DTensor) weight and bias. A rank holding no row
    of a ``RowsShard`` weight (``Plan.stored_rows``) computes an empty output from its empty piece, which
    FSDP leaves alone (``build.held_nothing``), so neither casts it under mixed precision nor moves it to
    the device under ``fsdp_offload=cpu``: made ``x``'s dtype and device here."""
    weight = local_view(module.weight)
    bias = local_view(module.bias) if with_bias and module.bias is not None else None
    if weight.numel() == 0:
        weight, bias = weight.to(x), bias.to(x) if bias is not None else None
    if is_conv1d(module):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
        return out.view(*x.shape[:-1], weight.shape[1])
    return nn.functional.linear(x, weight, bias)


def _local_linear_forward(module: nn.Module, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    """Linear/Conv1D on the local shards of packed parameters (rank r's rows of every part).

    ``mesh``: the style's TP mesh, the object the sibling column-parallel layers key their shared
    input by (``column_input``); the weight's ``device_mesh`` is an equal but distinct
    object, with which this layer's input gradient was all-reduced on its own (Qwen3.5's
    ``in_proj_qkv`` beside ``in_proj_z/b/a``: one all-reduce more per mixer backward)."""
    return local_linear(module, column_input(x, mesh))


class PackedColwiseParallel(ParallelStyle):
    """Fused projection of ``parts`` (their sizes), each sharded on its own (see module docstring);
    ``latent_input``: it reads a low-rank latent kept whole and computes on its input as it is, as
    ``LatentColwise`` (Zamba2's adapter up-projection, added to the packed ``gate_up_proj``)."""

    def __init__(self, parts: list[int], latent_input: bool = False):
        super().__init__()
        self.parts, self.latent_input = parts, latent_input

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        out_dim = 1 if is_conv1d(module) else 0
        placements = {"weight": packed_placement(out_dim, self.parts), "bias": packed_placement(0, self.parts)}
        shard_params(module, device_mesh, placements, self.src_data_rank)
        if self.latent_input:
            module.forward = types.MethodType(local_linear, module)
        else:
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
    bias = take_rows(local_view(module.bias), rows) if module.bias is not None else None
    return nn.functional.linear(x, take_rows(local_view(module.weight), rows), bias)


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
    ``parallel/infer/latent.py``): sharded by output features, computing on its input as it is, whose
    gradient from this rank's heads stays partial: it is summed over TP at the latent's input."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim = 1 if is_conv1d(module) else 0
        shard_params(module, device_mesh, {"weight": Shard(dim), "bias": Shard(0)}, self.src_data_rank)
        module.forward = types.MethodType(local_linear, module)
        return module
