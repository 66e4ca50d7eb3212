"""Turn a Hugging Face causal LM into a TP x FSDP2 model, without ever materializing it whole.

Order of application (as in torchtitan): build on the meta device -> tensor parallelism
(styles from the plan; every other parameter replicated on the TP mesh) -> FSDP2 per decoder
block, then the root -> allocate the local shards -> fill them (HF safetensors read shard by
shard through DCP, or a seeded init broadcast from rank 0 and sliced by each rank).

The model stays an ordinary ``transformers`` model: parallelism is applied to its modules, its
modeling code is never rewritten.
"""

from __future__ import annotations

import glob
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from peft import LoraConfig as PeftLoraConfig
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from shardlm.config import LoraConfig
from shardlm.distributed.mesh import Mesh
from shardlm.distributed.shards import fill_from_full, keep_parts_in, parts_placements
from shardlm.errors import ConfigError
from shardlm.parallel import lora, published
from shardlm.parallel.autotp import infer_plan
from shardlm.parallel.channels import check_fused_kernels
from shardlm.parallel.ep import apply_ep
from shardlm.parallel.hf import tied_keys
from shardlm.parallel.plan import Plan
from shardlm.parallel.seeded_init import UnwrittenInit, seeded_state
from shardlm.parallel.tp import localize_geometry, plan_styles, tp_partial_grad_params


@contextmanager
def _params_on_meta():
    """Create parameters on the meta device but keep buffers real (rotary ``inv_freq`` etc.),
    so nothing model-sized is allocated and no buffer needs recomputing afterwards."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _load_config(model_path: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config.use_cache = False
    return config


def build_meta_model(model_path: str) -> nn.Module:
    """The model's structure with parameters on the meta device (fp32 master weights)."""
    from transformers import AutoModelForCausalLM

    config = _load_config(model_path)
    try:
        with _params_on_meta():
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build: the user's model directory
        detail = " ".join(str(exc).split())[:200]
        raise ConfigError(
            f"model: transformers cannot build a causal LM from '{model_path}/config.json' "
            f"({type(exc).__name__}: {detail})"
        ) from None
    return model.float()


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks: the longest ModuleList whose children share one class."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            if len({type(m) for m in module}) == 1:
                best = list(module)
    return best


def apply_tp(model: nn.Module, mesh: Mesh, plan: Plan, with_lora: bool = False) -> None:
    """Apply the plan on the TP mesh (LoRA placements where peft adapted a layer, ``with_lora``);
    keep tied input/output embeddings tied."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    shared = _shared_parameters(model)
    styles = lora.lora_styles(model, plan) if with_lora else plan_styles(plan)
    if mesh.parallel.ep > 1:  # the experts are placed with EP (``apply_ep``)
        styles = {fqn: style for fqn, style in styles.items() if fqn not in plan.experts}
    parallelize_module(model, mesh.tp, styles, src_data_rank=None)
    localize_geometry(model, plan, mesh.parallel.tp)
    # a parameter registered in several modules stays one: the registration a style placed (BERT's
    # LM-head bias, placed by ``lm_head`` on ``decoder.bias``, is also ``cls.predictions.bias``)
    for places in shared:
        placed = [getattr(m, n) for m, n in places if isinstance(getattr(m, n), DTensor)]
        for module, name in places:
            if placed and getattr(module, name) is not placed[0]:
                setattr(module, name, placed[0])
    if tied:
        # both sides shard the vocabulary dimension (Shard(0)), so one DTensor serves both
        head.weight = emb.weight


def apply_fsdp(
    model: nn.Module, mesh: Mesh, mp_policy: MixedPrecisionPolicy | None = None, ignored: set | None = None
) -> None:
    """FSDP2 over the data-parallel mesh: one group per decoder block, the rest at the root;
    ``ignored``: parameters FSDP leaves alone (the experts under EP, ``parallel/ep.py``).

    Gradients are summed, not averaged, across data-parallel ranks (divide factor 1): the loss is
    already normalized by the global token count, see ``train/loss.py``.
    """
    kwargs = {"mesh": mesh.dp, "mp_policy": mp_policy or MixedPrecisionPolicy(), "ignored_params": ignored}
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter registered in more than one place (tied embeddings), as (module, name) lists."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module, name))
    return [p for p in places.values() if len(p) > 1]


def _retie(shared: list[list[tuple[nn.Module, str]]]) -> None:
    """``to_empty`` allocates each registration separately; point them back at one tensor."""
    for (owner, name), *others in shared:
        for module, other in others:
            setattr(module, other, getattr(owner, name))


def _restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    for name, buf in model.named_buffers():
        if name in buffers:
            buf.copy_(buffers[name])


def _base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{HF key: tensor}`` of everything an HF checkpoint holds: tied duplicates, LoRA adapters
    and ``modules_to_save`` copies left out, peft's ``base_layer``/``original_module`` unwrapped."""
    tied = tied_keys(model)
    state = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        hf = lora.hf_key(key)
        if key not in tied and hf is not None:
            state[hf] = tensor
    return state


def load_hf_weights(model: nn.Module, model_path: str) -> None:
    """Read safetensors shard by shard into the local pieces of every (D)Tensor (DCP's HF reader):
    each rank reads only its own rows, a packed projection's parts included (``distributed/shards.py``), the
    checkpoint's names and merged/concatenated tensors mapped by transformers' rules (``parallel/published.py``)."""
    published.load(_base_state(model), model_path, build_meta_model(model_path))


def init_from_seed(model: nn.Module, model_path: str, seed: int) -> None:
    """Random init that is identical for every layout and never whole on one rank: every rank
    draws the model's own init one decoder block at a time (``parallel/seeded_init.py``) and keeps its
    piece of each tensor (``local_piece`` knows every placement, packed ones too)."""
    # parameters only: buffers keep the values they were built with (``_restore_buffers``)
    targets = {k: v for k, v in _base_state(model).items() if isinstance(v, nn.Parameter)}
    try:
        meta = build_meta_model(model_path)
        aliases = _aliases(meta)
        filled = set()
        for drawn, tensor in seeded_state(meta, decoder_blocks(meta), seed):
            for key in aliases.get(drawn, [drawn]):  # a shared weight is drawn under one of its names
                if key in targets:
                    fill_from_full(targets[key], tensor)  # the piece is cut on the CPU, then copied over
                    filled.add(key)
    except UnwrittenInit as exc:
        if dist.get_rank() == 0:
            print(f"random init: {exc}; building the whole model on rank 0 instead", flush=True)
        _init_from_whole_model(targets, model_path, seed)
        return
    # persistent buffers (MoE routing's e_score_correction_bias) keep the meta build's values (_restore_buffers)
    unfilled = sorted(k for k, t in targets.items() if k not in filled and isinstance(t, nn.Parameter))
    if unfilled:
        raise RuntimeError(f"random init drew no value for {unfilled[0]}")


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter registered under several names (tied weights) -> all its names."""
    names: dict[int, list[str]] = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(key)
    return {key: keys for keys in names.values() if len(keys) > 1 for key in keys}


def _init_from_whole_model(targets: dict[str, torch.Tensor], model_path: str, seed: int) -> None:
    """The fallback: rank 0 builds the model from ``torch.manual_seed(seed)``, tensor by tensor it
    is broadcast and every rank keeps its piece."""
    full = _whole_seeded_model(model_path, seed).state_dict() if dist.get_rank() == 0 else {}
    for key, target in targets.items():
        tensor = full[key] if dist.get_rank() == 0 else torch.empty(target.shape, dtype=target.dtype)
        tensor = tensor.to(device=target.device, dtype=target.dtype)
        if dist.get_world_size() > 1:
            dist.broadcast(tensor, src=0)
        fill_from_full(target, tensor)


def _whole_seeded_model(model_path: str, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_load_config(model_path)).float()


@torch.no_grad()
def reference_model(model_path: str, seed: int) -> nn.Module:
    """The plain one-process model shardlm starts from (also what tests compare against): the
    same values ``init_from_seed`` gives every layout."""
    model = _whole_seeded_model(model_path, seed)
    try:
        meta = build_meta_model(model_path)
        for key, tensor in seeded_state(meta, decoder_blocks(meta), seed):
            model.get_parameter(key).copy_(tensor)  # a tied weight: under whichever name it was drawn
    except UnwrittenInit:
        return _whole_seeded_model(model_path, seed)
    return model


def has_weights(model_path: str) -> bool:
    return bool(glob.glob(os.path.join(model_path, "*.safetensors")))


@dataclass
class ParallelModel:
    """What ``parallelize`` hands the trainer and the checkpointer (nothing is stored on the module).

    ``module``: the ``transformers`` model with DTensor/FSDP2 parameters. ``plan``: the TP plan it
    was split by (its dropout sites key the dropout masks). ``tp_partial_grads``: parameters whose
    gradients each TP rank holds only a partial sum of, summed over TP before clipping.
    ``fsdp_param_dtype``: the dtype FSDP2 computes in (bf16 when its policy casts; then the trainer
    does not autocast). ``lora``: the peft ``LoraConfig`` of the adapters, None for full training.
    ``expert_grads``: under EP, the experts' parameters, whose gradients are summed over
    ``expert_dp_group`` (the data-parallel ranks holding the same experts; None: none).
    """

    module: nn.Module
    plan: Plan
    tp_partial_grads: list[nn.Parameter]
    fsdp_param_dtype: torch.dtype | None = None
    lora: PeftLoraConfig | None = None
    expert_grads: list[str] | None = None
    expert_dp_group: dist.ProcessGroup | None = None


def parallelize(
    model_path: str,
    mesh: Mesh,
    seed: int = 0,
    mp_policy: MixedPrecisionPolicy | None = None,
    lora_config: LoraConfig | None = None,
    frozen_dtype: torch.dtype | None = None,
) -> ParallelModel:
    """Build, parallelize and fill the model at ``model_path`` for ``mesh``.

    ``mp_policy``: FSDP2 mixed precision, used only where FSDP is on (dp > 1); the dtype it
    computes in is returned as ``fsdp_param_dtype`` so the trainer knows whether it must
    autocast itself (``trainer.mixed_precision_policy``). ``lora_config``: peft LoRA
    adapters on the plan's projections (``parallel/lora.py``); only they (and ``modules_to_save``) train.
    ``frozen_dtype``: storage dtype of parameters that do not train (a bf16 base under LoRA).
    """
    model = build_meta_model(model_path)
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    plan = infer_plan(model, mesh.parallel.tp)
    peft_cfg = lora.inject(model, lora_config) if lora_config is not None else None
    if frozen_dtype is not None:
        for name, param in model.named_parameters():  # each tensor once: tied parameters stay one
            # a modules_to_save original stays fp32: its trained copy starts from it (lora.copy_modules_to_save)
            if not param.requires_grad and param.is_floating_point() and ".original_module." not in name:
                param.data = param.data.to(frozen_dtype)
    if mesh.parallel.tp > 1:
        if mesh.device.type == "cuda":
            check_fused_kernels(model, plan, mesh.parallel.tp)
        apply_tp(model, mesh, plan, with_lora=peft_cfg is not None)
    experts = apply_ep(model, mesh.experts, plan.experts) if mesh.parallel.ep > 1 else []
    parts = parts_placements(model)  # FSDP's parameters and to_empty's are new tensors: see PartsShard
    if mesh.parallel.dp_size > 1:
        apply_fsdp(model, mesh, mp_policy, {model.get_parameter(n) for n in experts})
    shared = _shared_parameters(model)
    model.to_empty(device=mesh.device)
    _retie(shared)
    keep_parts_in(dict(model.named_parameters()), parts)
    with torch.no_grad():
        _restore_buffers(model, buffers)
    if has_weights(model_path):
        load_hf_weights(model, model_path)
    else:
        init_from_seed(model, model_path, seed)
    if lora_config is not None:
        lora.copy_modules_to_save(model)
        if lora_config.adapter:
            lora.load_adapter(model, lora_config.adapter)
        else:
            lora.init_adapters(model, seed)
    model.train()
    partial = tp_partial_grad_params(model, plan)
    if lora_config is not None and mesh.parallel.tp > 1:
        partial += lora.tp_partial_grad_params(model, plan)
    fsdp_on = mesh.parallel.dp_size > 1 and mp_policy is not None
    dtype = mp_policy.param_dtype if fsdp_on else None
    return ParallelModel(model, plan, partial, dtype, peft_cfg, experts, mesh.expert_dp_group if experts else None)
