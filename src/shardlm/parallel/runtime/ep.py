"""Expert parallelism (``parallel.ep``): each rank of an expert-parallel group holds E/ep of every
mixture-of-experts layer's experts, and tokens travel to the rank owning their chosen expert and
back by all-to-all (torchtitan's design; DeepSpeed's AutoEP likewise).

Ranks: the ``ep`` ranks are carved out of the data- and context-parallel ranks, ``fsdp x cp``
first (``distributed/mesh.py``: ``dp_replicate x fsdp x cp`` = ``edp x ep``; ``ep=2`` alone is
``dp_replicate=2``), so they hold different tokens (other micro-batches, or other chunks of the same
windows under ``parallel.cp``); the global batch, the token-weighted loss and the data order are
those of the same layout without EP.

Parameters: every parameter of an experts module (``experts.experts_modules``: fused 3-D
``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, biases ``[E, X]``) becomes a DTensor on the
``(ep, tp)`` mesh, ``Shard(0)`` over ``ep`` (rank r holds experts ``[r E/ep, (r+1) E/ep)``) and its
TP placement (``Plan.experts``, ``runtime.experts.expert_placements``) over ``tp``; DCP therefore saves and
reshards them across ep and tp sizes like any DTensor. FSDP leaves them out (``ignored_params``):
an expert's gradient sums the contributions of every token routed to it from the whole EP group
(the all-to-all's backward brings them), so it is complete on its rank; it is summed over the
data-parallel ranks left, ``edp``, which hold the same experts
(``Mesh.expert_dp_group``, ``sum_expert_grads``), never over ``ep``. The global gradient norm
(``distributed/clip.py``) counts each expert once: the placements say which ranks hold copies.

Forward, per experts module (its own forward, ``(hidden_states, top_k_index, top_k_weights)``,
whatever experts kernel transformers runs, wrapped by hooks as ``runtime.experts.ExpertsParallel`` is): the
(token, choice) pairs are sorted by expert; one all-to-all exchanges the per-expert counts, one
moves the rows; the module's forward runs on the received rows with this rank's experts (its
expert count attributes set to E/ep, ``experts.count_attrs``), each row routed to its local expert
with weight 1; one all-to-all brings the rows back, where they are weighted by the router and
summed per token. That is the module's function whenever it is linear in the routing weights
(``sum_k w_k f_{e_k}(x)``), which is what the experts kernels compute. Under TP each rank computes
its share of every local expert, and the summed output is all-reduced over TP once, as without EP.
The router stays replicated (it sees only its rank's tokens and needs no collective). Under
``parallel.sequence_parallel`` the MoE block is gathered whole (``plan/sequence.py``): all of this
runs on the whole sequence, as without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardlm.errors import ConfigError
from shardlm.parallel.model.experts import KERNEL, count_attrs, experts_call, experts_modules
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import ExpertParam, Style, local_shape, sharded_dim
from shardlm.parallel.runtime.experts import expert_placements
from shardlm.parallel.runtime.grads import sum_tp_partial_grads
from shardlm.parallel.runtime.regions import CopyToRegion, reduce_from_region


def check_ep(model: nn.Module, ep: int) -> None:
    """Refuse ``parallel.ep`` for a model without fused experts, with experts that take every token
    (not called with top-k indices, ``experts_call``: Llama 4, Inkling's shared experts), or whose expert
    count ``ep`` does not divide (preflight, before spawning)."""
    if ep == 1:
        return
    found = experts_modules(model)
    if not found:
        raise ConfigError(
            f"parallel.ep={ep}: {type(model).__name__} has no fused mixture-of-experts layer to divide between "
            "ranks; set parallel.ep to 1"
        )
    for fqn in found:
        module = model.get_submodule(fqn)
        if experts_call(module) != KERNEL:
            raise ConfigError(
                f"parallel.ep={ep}: {fqn} ({type(module).__name__}) runs every expert on every token (its "
                "forward takes no top-k expert indices), so no token is sent to one expert's rank; set parallel.ep to 1"
            )
        count = next(module.parameters()).shape[0]
        if count % ep:
            raise ConfigError(
                f"parallel.ep={ep} must divide the {count} experts of {fqn}; set parallel.ep to a divisor of {count}"
            )


def check_ep_lora(model: nn.Module) -> None:
    """Under ``parallel.ep``, refuse a LoRA ``modules_to_save`` copy of an experts module (``model``:
    the meta model peft adapted): the copy and its frozen original would each need the expert
    dispatch. Adapters on the experts themselves are refused by peft's targeting (fused 3-D
    parameters are not linear layers) or by ``lora.check_lora``; adapters on attention and on
    dense or shared-expert projections train as without EP."""
    for fqn in experts_modules(model):
        if ".modules_to_save." in fqn or ".original_module." in fqn:
            wrapper = fqn.split(".modules_to_save.")[0].split(".original_module.")[0]
            raise ConfigError(
                f"lora.modules_to_save: '{wrapper}' holds routed experts ({fqn}), which shardlm cannot train as a "
                "separate copy under parallel.ep > 1; remove it from modules_to_save or set parallel.ep to 1"
            )


def describe_ep(model: nn.Module, plan: Plan, tp: int, ep: int) -> list[str]:
    """``shardlm plan --ep``: per experts module, the experts each rank holds, its local shapes
    (TP's split of each expert, then ``Shard(0)`` over ep) and fp32 bytes per rank."""
    check_ep(model, ep)
    lines = []
    for fqn in experts_modules(model):
        module = model.get_submodule(fqn)
        count, shapes, local_bytes, whole = next(module.parameters()).shape[0], [], 0, 0
        for name, p in module.named_parameters(recurse=False):
            dim = sharded_dim(Style.EXPERTS, module, name, plan.experts.get(fqn)) if tp > 1 else None
            shape = local_shape(local_shape(tuple(p.shape), dim, tp), 0, ep)
            shapes.append(f"{name} {'x'.join(map(str, shape))}")
            local_bytes, whole = local_bytes + 4 * torch.Size(shape).numel(), whole + 4 * p.numel()
        lines.append(
            f"experts {fqn}: {count // ep} of {count} experts per rank (ep={ep}, tp={tp}): {', '.join(shapes)}; "
            f"{local_bytes / 2**20:.3f} MB per rank of {whole / 2**20:.3f} MB"
        )
    return lines


def _zero_grad_term(params: list[torch.Tensor]) -> torch.Tensor:
    """0, depending on every local parameter: a rank none of whose experts got a token this step
    still gets (zero) gradients, as one process's fused parameters always do (AdamW's decay and
    moments then step the same)."""
    return sum(p.reshape(-1)[0] for p in params) * 0


class ExpertsDispatch:
    """The hooks of one experts module under EP (see the module docstring)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, layout: dict[str, ExpertParam]):
        self.mesh, self.layout = mesh, layout
        self.ep_group = mesh["ep"].get_group()
        self.ep, self.tp = mesh.size(0), mesh.size(1)
        self.count = next(module.parameters()).shape[0]
        self.local_count = self.count // self.ep
        self.muted = mesh["tp"].get_local_rank() != 0  # parameters added ``once`` over TP
        self.attrs = count_attrs(module)
        self.stack: list[tuple] = []  # per call in flight (activation checkpointing reruns nest)

    def place(self, module: nn.Module) -> None:
        tp_placements = expert_placements(module, self.layout)
        for name, param in list(module.named_parameters(recurse=False)):
            placed = distribute_tensor(param, self.mesh, [Shard(0), tp_placements[name]], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))

    def dispatch(self, module: nn.Module, args: tuple, kwargs: dict):
        hidden, index, weights = (*args, *kwargs.values())
        x = hidden.reshape(-1, hidden.shape[-1])
        if self.tp > 1:  # each TP rank's input gradients cover its share of the experts: summed over TP
            x, weights = CopyToRegion.apply(self.mesh["tp"], x, weights)
        k = index.shape[-1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.count)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)
        send = counts.view(self.ep, -1).sum(1).tolist()
        recv = received.view(self.ep, -1).sum(1).tolist()
        rows = all_to_all_single_autograd(x[order // k], recv, send, self.ep_group)
        ids = torch.arange(self.local_count, device=flat.device).repeat(self.ep).repeat_interleave(received)
        saved, local = [], []
        for name, param in list(module._parameters.items()):
            saved.append((name, param))
            value = param.to_local().to(rows.dtype)
            local.append(value)
            once = self.layout.get(name)
            module._parameters[name] = value * 0 if self.muted and once is not None and once.once else value
        for attr in self.attrs:
            setattr(module, attr, self.local_count)
        self.stack.append((hidden.shape, order, send, recv, weights, k, saved, local))
        ones = torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=rows.device)
        return (rows, ids[:, None], ones), {}

    def combine(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        shape, order, send, recv, weights, k, saved, local = self.stack.pop()
        for name, param in saved:
            module._parameters[name] = param
        for attr in self.attrs:
            setattr(module, attr, self.count)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(module).__name__} returned {type(out).__name__}, not one tensor")
        back = all_to_all_single_autograd(out + _zero_grad_term(local), send, recv, self.ep_group)
        pairs = back[torch.argsort(order)].view(-1, k, back.shape[-1])
        y = (pairs * weights.reshape(-1, k, 1).to(pairs.dtype)).sum(1)
        if self.tp > 1:  # each TP rank's output is its share of every expert: one all-reduce
            y = reduce_from_region(y, self.mesh["tp"])
        return y.reshape(shape).clone()  # a tensor of its own (models add into it in place)


def apply_ep(model: nn.Module, mesh: DeviceMesh, layouts: dict[str, dict[str, ExpertParam]]) -> list[str]:
    """Divide every experts module of ``model`` (on meta) over ``mesh`` ``(ep, tp)``; ``layouts``: the
    plan's TP placements (empty at tp=1). Returns the FQNs of the experts' parameters."""
    names = []
    for fqn in experts_modules(model):
        module = model.get_submodule(fqn)
        hooks = ExpertsDispatch(module, mesh, layouts.get(fqn, {}))
        hooks.place(module)
        module.register_forward_pre_hook(hooks.dispatch, with_kwargs=True)
        module.register_forward_hook(hooks.combine)
        names += [f"{fqn}.{name}" for name, _ in module.named_parameters(recurse=False)]
    return names


def sum_expert_grads(model: nn.Module, names: list[str], group: dist.ProcessGroup | None) -> None:
    """Sum the experts' gradients over the data-parallel ranks holding the same experts (``group``:
    ``Mesh.expert_dp_group``; None: no other rank holds them)."""
    if group is not None:
        sum_tp_partial_grads(model, names, group)
