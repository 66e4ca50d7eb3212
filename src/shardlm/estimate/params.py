"""Parameters and weights a rank holds: the TP plan's chunk of each tensor, then FSDP2's chunk of dim 0,
LoRA's adapters placed like their base, the rows a rank copies out of tensors stored whole, and the
weights in the compute dtype held beside the master shards.

``compute_weights``: with FSDP, the gathered copies it computes with (root + two blocks with
prefetch, in the compute dtype); without FSDP under bf16, autocast's bf16 copy of every local weight
(cached for the forward, kept for the backward). ``reduce_scatter``: with FSDP, the unsharded fp32
gradients of one decoder block that FSDP2 fills before reducing them (the root's are filled at the
end of backward, when the activations are gone).
"""

from __future__ import annotations

import math

from torch import nn

from shardlm.errors import ConfigError
from shardlm.parallel.model.experts import experts_modules
from shardlm.parallel.model.hf import is_conv1d
from shardlm.parallel.model.meta import decoder_blocks
from shardlm.parallel.plan.channels import param_rows
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.rows import lead_dim
from shardlm.parallel.plan.styles import local_shape, lora_dims, sharded_dim

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def local_numel(shape: tuple[int, ...], tp_dim: int | None, tp: int, fsdp: int) -> int:
    """Elements of the largest local piece: TP chunk of ``tp_dim``, then FSDP's chunk of dim 0."""
    dims = list(shape)
    if tp_dim is not None:
        dims[tp_dim] = math.ceil(dims[tp_dim] / tp)
    if dims and fsdp > 1:
        dims[0] = math.ceil(dims[0] / fsdp)
    return math.prod(dims)


def _lora_shapes(module: nn.Module, r: int, style: str | None) -> list[tuple[tuple[int, int], int | None]]:
    """(shape, tp dim) of lora_A ``[r, in]`` and lora_B ``[out, r]`` for a targeted linear."""
    w = module.weight
    fan_in, fan_out = (w.shape[0], w.shape[1]) if is_conv1d(module) else (w.shape[1], w.shape[0])
    a_dim, b_dim = lora_dims(style) if style is not None else (None, None)
    return [((r, fan_in), a_dim), ((fan_out, r), b_dim)]


def count_params(
    model: nn.Module,
    styles: dict[str, str],
    tp: int,
    fsdp: int,
    lora_r: int | None = None,
    experts: dict | None = None,
    ep: int = 1,
) -> tuple[int, int, int, int]:
    """(full, local, trainable local, trainable tensors) parameter counts; tied parameters count once.
    ``experts``: the plan's per-parameter placements of ``experts`` modules (``Plan.experts``).
    ``ep`` > 1: the experts modules' parameters are divided over ep on dim 0, not chunked by FSDP."""
    experts = experts or {}
    ep_modules = set(experts_modules(model)) if ep > 1 else set()
    seen: set[int] = set()
    full = local = trainable = 0
    targeted = tensors = 0
    for mname, module in model.named_modules():
        style = styles.get(mname)
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            dim = sharded_dim(style, module, pname, experts.get(mname))
            if mname in ep_modules:  # Shard(0) over ep, TP inside each expert, left out by FSDP
                n = local_numel(local_shape(tuple(param.shape), 0, ep), dim, tp, 1)
            else:
                n = local_numel(tuple(param.shape), dim, tp, fsdp)
            full += param.numel()
            local += n
            trainable += 0 if lora_r else n
            tensors += 0 if lora_r else 1
        if lora_r and mname.rsplit(".", 1)[-1] in LORA_TARGETS and hasattr(module, "weight"):
            targeted += 1
            for shape, dim in _lora_shapes(module, lora_r, style):
                n = local_numel(shape, dim, tp, fsdp)
                full += math.prod(shape)
                local += n
                trainable += n
                tensors += 1
    if lora_r and not targeted:
        raise ConfigError(
            f"--lora-r: no linear layer of this model is named {'/'.join(LORA_TARGETS)}; LoRA has no target"
        )
    return full, local, trainable, tensors


def row_copies(model: nn.Module, plan: Plan) -> dict[str, int]:
    """Per parameter fqn, the elements a TP rank copies out of several row ranges of it where it is
    stored whole (``linear.take_rows``: a sliced projection of parts some held whole such as Mamba-2's
    ``in_proj`` at ``n_groups < tp``, the conv following it), saved for backward by the op using
    them: one copy per forward of their layer."""
    ranks_rows = [(fqn, "weight", rows) for fqn, rows in plan.sliced.items()]  # per rank: its row ranges
    ranks_rows += [(fqn, p, param_rows(plan, fqn, p)) for fqn, names in plan.channels.items() for p in names]
    copies = {}
    for fqn, pname, rows in ranks_rows:
        module = model.get_submodule(fqn)
        # a bias is only added, its copy not kept; a buffer's rows (Falcon-H1's ``mup_vector``) are
        # counted with its mixer (``scans.py``), as one process keeps the buffer itself
        params = dict(module.named_parameters(recurse=False))
        if rows is not None and len(rows[0]) > 1 and pname != "bias" and pname in params:
            p = params[pname]
            copies[f"{fqn}.{pname}"] = sum(b - a for a, b in rows[0]) * (p.numel() // p.shape[lead_dim(p)])
    return copies


def local_channels(plan: Plan, conv: str, channels: int, tp: int) -> int:
    """The channels of ``per_channel`` convolution ``conv`` rank 0 computes: its rows where it is
    stored whole (Mamba-2's, whose B and C parts stay whole at ``n_groups < tp``), else ``1/tp``."""
    rows = param_rows(plan, conv, "weight")
    if rows is None:
        return channels // tp
    return sum(b - a for a, b in rows[0])


def tp_local_elements(
    model: nn.Module, styles: dict[str, str], tp: int, prefix: str = "", experts: dict | None = None, skip=()
) -> int:
    """Elements ``model`` (or a submodule whose fqn is ``prefix``) holds per TP rank, before FSDP;
    ``skip``: module fqns left out (the experts under EP, which FSDP does not gather)."""
    experts = experts or {}
    seen: set[int] = set()
    n = 0
    for mname, sub in model.named_modules():
        fqn = ".".join(x for x in (prefix, mname) if x)
        for pname, p in sub.named_parameters(recurse=False):
            if id(p) not in seen and fqn not in skip:
                seen.add(id(p))
                n += local_numel(tuple(p.shape), sharded_dim(styles.get(fqn), sub, pname, experts.get(fqn)), tp, 1)
    return n


def block_elements(
    model: nn.Module, styles: dict[str, str], tp: int, experts: dict | None = None, skip=()
) -> tuple[int, int]:
    """(TP-local elements of one decoder block, number of blocks); the whole model when it has none."""
    blocks = decoder_blocks(model)
    if not blocks:
        return tp_local_elements(model, styles, tp, experts=experts, skip=skip), 1
    names = {id(m): n for n, m in model.named_modules()}
    return tp_local_elements(blocks[0], styles, tp, names[id(blocks[0])], experts, skip), len(blocks)


def _gathered_elements(model: nn.Module, styles: dict[str, str], tp: int, experts: dict | None = None, skip=()) -> int:
    """TP-local elements FSDP all-gathers at once: the root's parameters plus two decoder blocks (prefetch)."""
    block, count = block_elements(model, styles, tp, experts, skip)
    return tp_local_elements(model, styles, tp, experts=experts, skip=skip) - count * block + min(2, count) * block


def compute_weight_bytes(
    model: nn.Module, styles: dict[str, str], tp: int, fsdp: int, bf16: bool, experts: dict | None = None, skip=()
) -> int:
    """Weights in the compute dtype held beside the master shards (see the module docstring)."""
    if fsdp > 1:
        return (2 if bf16 else 4) * _gathered_elements(model, styles, tp, experts, skip)
    return 2 * tp_local_elements(model, styles, tp, experts=experts) if bf16 else 0
