"""Turn a Hugging Face causal LM into a TP x FSDP2 model, without ever materializing it whole.

Order of application (as in torchtitan): build on the meta device -> tensor parallelism
(styles from the plan; every other parameter replicated on the TP mesh) -> FSDP2 per decoder
block, then the root -> allocate the local shards -> fill them (HF safetensors read shard by
shard through DCP, or a seeded init broadcast from rank 0 and sliced by each rank).

The model stays an ordinary ``transformers`` model: parallelism is applied to its modules, its
modeling code is never rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from peft import LoraConfig as PeftLoraConfig
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from shardlm.config import LoraConfig
from shardlm.distributed.mesh import Mesh
from shardlm.distributed.shards import keep_placements, tp_placements
from shardlm.parallel.infer.autotp import infer_plan
from shardlm.parallel.infer.channels import check_fused_kernels
from shardlm.parallel.infer.stages import stage_layout
from shardlm.parallel.model.experts import experts_modules
from shardlm.parallel.model.hf import tower_parameters
from shardlm.parallel.model.meta import build_meta_model, decoder_blocks, recomputed_in_backward, shared_modules
from shardlm.parallel.plan.head_inputs import slice_head_inputs
from shardlm.parallel.plan.local_geometry import localize_geometry
from shardlm.parallel.plan.local_reshape import reshape_locally
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.sequence import scattered_rows, stream_ends
from shardlm.parallel.plan.stages import rank_stages
from shardlm.parallel.runtime import lora
from shardlm.parallel.runtime.context import check_context_parallel, enable_context_parallel
from shardlm.parallel.runtime.ep import apply_ep
from shardlm.parallel.runtime.grads import tp_partial_grad_params
from shardlm.parallel.runtime.head_einsums import sum_head_einsums
from shardlm.parallel.runtime.indexer import sum_indexer_scores
from shardlm.parallel.runtime.pipeline import (
    PipelineStageModule,
    RankStages,
    join_stages,
    keep_stage,
    stage_plan,
    tie_on_one_rank,
)
from shardlm.parallel.runtime.plan_styles import plan_styles
from shardlm.parallel.runtime.replicate import serve_direct_reads
from shardlm.parallel.runtime.row_reads import serve_row_reads
from shardlm.parallel.runtime.sequence import apply_sequence_parallel
from shardlm.parallel.weights.fill import has_weights, init_from_seed, load_hf_weights, restore_buffers


def apply_tp(model: nn.Module, mesh: Mesh, plan: Plan, with_lora: bool = False) -> None:
    """Apply the plan on the TP mesh (LoRA placements where peft adapted a layer, ``with_lora``);
    keep tied input/output embeddings tied."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and emb is not None and getattr(head, "weight", None) is emb.weight  # a stage: one of them
    shared = _shared_parameters(model)
    sequence = mesh.parallel.sequence_parallel
    ends = stream_ends(model, plan) if sequence else None  # the embedding reduce-scatters to the slices
    scattered = (scattered_rows(model, plan) | ({ends[0]} if ends else set())) if sequence else set()
    styles = lora.lora_styles(model, plan, scattered) if with_lora else plan_styles(plan, scattered)
    if mesh.parallel.ep > 1:  # the experts are placed with EP (``apply_ep``); not the other modules of
        # ``plan.experts``, the per-channel ones (gpt-oss's attention with its sinks, a hybrid's mixers)
        ep_placed = set(experts_modules(model))
        styles = {fqn: style for fqn, style in styles.items() if fqn not in ep_placed}
    tp_mesh = mesh.tp  # one object: the sequence hooks and the styles key their shared views by it
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    # before the local head counts: each module's whole count sizes the per-head inputs it is handed
    slice_head_inputs(model, plan, mesh.parallel.tp, mesh.tp.get_local_rank())  # BLOOM's ALiBi: its heads'
    localize_geometry(model, plan, mesh.parallel.tp)
    reshape_locally(model, plan, mesh.parallel.tp)  # TrOCR: its heads' output to a rank's share of the width
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
    serve_row_reads(model, plan, tp_mesh)  # Gemma 4's pad row, read off the split embedding
    serve_direct_reads(model, plan)  # Gemma 3n's AltUp coefficients, read whole by the decoder layer
    sum_indexer_scores(model, plan, tp_mesh)  # DSA's indexer: its heads' scores summed over TP before its top-k
    sum_head_einsums(model, plan, tp_mesh)  # XLNet's attention: its einsums' sums over TP
    if sequence:
        apply_sequence_parallel(model, plan, tp_mesh)


def held_nothing(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of which this TP rank holds no element (a ``RowsShard`` of no row for it: Zaya's
    ``v_proj_delayed`` on rank 0 at tp=2). FSDP leaves them alone: torch's reduce-scatter refuses an empty
    gradient (``_chunk_cat``), and there is nothing to shard or to reduce over the data-parallel ranks, which
    hold the same empty piece (they share the TP coordinate). Not cast under mixed precision either:
    ``linear.local_linear`` makes them their input's dtype and device."""
    return {p for p in model.parameters() if isinstance(p, DTensor) and p.to_local().numel() == 0}


def apply_fsdp(
    model: nn.Module, mesh: Mesh, mp_policy: MixedPrecisionPolicy | None = None, ignored: set | None = None
) -> None:
    """FSDP2 over the data-parallel mesh: one group per decoder block, the rest at the root;
    ``ignored``: parameters FSDP leaves alone (the experts under EP, ``parallel/runtime/ep.py``; pieces of no
    element, ``held_nothing``).

    Gradients are summed, not averaged, across data-parallel ranks (divide factor 1): the loss is
    already normalized by the global token count, see ``train/loss.py``.

    Under a schedule that splits the backward (``ParallelConfig.pp_split_backward``) the blocks stay
    unsharded after their forward, as torchtitan keeps them under pp: torch's input pass finds the
    weights' gradient nodes from the stage's registered parameters, and a block resharded after its
    forward registers shards the graph never used, so its weight gradients were never computed
    (measured: ZBVZeroBubble x fsdp=2 left a stage's blocks without gradients, grad_norm 1.4423
    against one process's 1.5209). The schedule reshards a stage once its step is done.

    Modules of several blocks tied to one set of parameters (Zamba's shared transformer) are a group of
    their own, gathered at each of their calls. A block the model reruns in its backward from a custom
    autograd function (Reformer's reversible layers, ``recomputed_in_backward``) stays unsharded after
    its forward: the rerun meets its whole weights, and FSDP's final backward callback reduce-scatters
    its gradients (its own post-backward hook never fires: its forward ran with gradients off).

    Without pipeline parallelism the last block and the root stay unsharded after their forward, as
    torchtitan keeps them: the backward starts with them, so resharding them only to all-gather them
    again at once costs two all-gathers a step (and their copy-in/copy-out) and saves no memory at the
    step's peak (FSDP2 prefetches the last block when the backward starts). The root is FSDP2's own
    default (it does not reshard the root after forward unless told to); under pp the stages' blocks
    keep resharding (a stage runs several micro-batches' forwards before their backwards).
    """
    p = mesh.parallel
    kwargs = {
        "mesh": mesh.dp,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "ignored_params": ignored,
        "offload_policy": offload_policy(mesh),
    }
    blocks = decoder_blocks(model)
    for modules in shared_modules(blocks):  # before the blocks, which then leave their parameters to them
        fully_shard(modules, **kwargs)
    for i, block in enumerate(blocks):
        last = p.pp == 1 and i == len(blocks) - 1
        keep = p.pp_split_backward or last or recomputed_in_backward(block)
        fully_shard(block, reshard_after_forward=not keep, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def offload_policy(mesh: Mesh) -> OffloadPolicy:
    """FSDP2's policy for ``parallel.fsdp_offload``: with ``cpu`` each rank's shards of parameters
    and gradients live in host memory (the optimizer state with them, as it is made like its
    parameter); FSDP2 copies a block's shards to the device for its all-gather and its gradient
    shards back after the reduce-scatter, and the optimizer steps on the CPU. Pinned host memory
    (asynchronous copies) needs CUDA. On a CPU-only machine the shards are already in host memory:
    the policy changes nothing there but FSDP2's code path (docs/config.md)."""
    if mesh.parallel.fsdp_offload != "cpu" or mesh.parallel.dp_size == 1:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=mesh.device.type == "cuda")


def _materialize(model: nn.Module, mesh: Mesh) -> None:
    """Allocate the meta model's local pieces: on the device, or on the host for the parameters
    FSDP2 offloads (it checks they start there); buffers always on the device, moved after the fill."""
    shared = _shared_parameters(model)
    offloaded = isinstance(offload_policy(mesh), CPUOffloadPolicy)
    model.to_empty(device="cpu" if offloaded else mesh.device)
    _retie(shared)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move every buffer (rotary frequencies, ...) to ``device``, where the forward computes."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.device != device:
                setattr(module, name, buf.to(device))


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
    ``stage``: under pipeline parallelism, what this rank's pipeline stage runs (``module`` then holds
    only that stage's parameters, under the whole model's names; ``parallel/runtime/pipeline.py``), or
    the ``RankStages`` it runs under a schedule with several stages a rank (``module`` then joins them).
    """

    module: nn.Module
    plan: Plan
    tp_partial_grads: list[nn.Parameter]
    fsdp_param_dtype: torch.dtype | None = None
    lora: PeftLoraConfig | None = None
    expert_grads: list[str] | None = None
    expert_dp_group: dist.ProcessGroup | None = None
    stage: PipelineStageModule | RankStages | None = None


def _rank_stages(model_path: str, mesh: Mesh, args: tuple) -> ParallelModel:
    """This rank's stages under a schedule with several a rank (``parallel.pp_virtual_stages``), each built
    by ``parallelize`` from a model of its own, joined into one module under the whole model's names
    (``runtime/pipeline.py: join_stages``) for the optimizer and checkpoints; ``stage`` holds them all."""
    p = mesh.parallel
    indices = rank_stages(mesh.pp.get_local_rank(), p.pp, p.pp_stages_per_rank, p.pp_v_shaped)
    parts = [parallelize(model_path, mesh, *args, stage_index=i) for i in indices]
    stages = RankStages([part.stage for part in parts])
    layout = stage_layout(build_meta_model(model_path), p.pp * p.pp_stages_per_rank)
    if layout.tied and any(s.first for s in stages) and any(s.last for s in stages):
        tie_on_one_rank(stages, layout)
    partial = [name for part in parts for name in part.tp_partial_grads]  # every stage's, summed over TP
    return replace(parts[0], module=join_stages(stages, layout), stage=stages, tp_partial_grads=partial)


def _stage_and_adapters(
    model: nn.Module, mesh: Mesh, plan: Plan, lora_config: LoraConfig | None, stage_index: int | None
) -> tuple[Plan, PipelineStageModule | None, PeftLoraConfig | None, list[tuple[str, torch.Size]]]:
    """The LoRA adapters injected (``lora_config``), then, under ``parallel.pp``, the model cut to this rank's
    stage before anything is placed (``parallel/runtime/pipeline.py``) and the plan narrowed to it: (the
    plan, the stage or None, the peft config or None, the whole model's trainable parameters in order).
    The stages are balanced on the model without adapters (what ``shardlm plan --pp`` shows); the adapters
    of the whole model are listed before the cut, so a stage draws or reads its own as one process would."""
    p = mesh.parallel
    layout = stage_layout(model, p.pp * p.pp_stages_per_rank) if p.pp > 1 else None
    peft_cfg = lora.inject(model, lora_config) if lora_config is not None else None
    adapters = [(name, p.shape) for name, p in model.named_parameters() if p.requires_grad] if peft_cfg else []
    if layout is None:
        return plan, None, peft_cfg, adapters
    index = mesh.pp.get_local_rank() if stage_index is None else stage_index  # ``stage_index``: ``parallelize``'s
    keep_stage(model, layout, index)
    stage = PipelineStageModule(model, layout, index)
    return stage_plan(plan, model), stage, peft_cfg, adapters


def parallelize(
    model_path: str,
    mesh: Mesh,
    seed: int = 0,
    mp_policy: MixedPrecisionPolicy | None = None,
    lora_config: LoraConfig | None = None,
    frozen_dtype: torch.dtype | None = None,
    train_towers: bool = False,
    stage_index: int | None = None,
) -> ParallelModel:
    """Build, parallelize and fill the model at ``model_path`` for ``mesh``.

    ``mp_policy``: FSDP2 mixed precision, used only where FSDP is on (dp x cp > 1); the dtype it
    computes in is returned as ``fsdp_param_dtype`` so the trainer knows whether it must
    autocast itself (``trainer.mixed_precision_policy``). ``lora_config``: peft LoRA
    adapters on the plan's projections (``parallel/runtime/lora.py``); only they (and ``modules_to_save``) train.
    ``frozen_dtype``: storage dtype of parameters that do not train (a bf16 base under LoRA).
    ``train_towers``: a multimodal checkpoint's vision/audio tower and projector train too
    (``train.train_vision_tower``); by default they are frozen (``hf.tower_parameters``).
    ``stage_index``: under pipeline parallelism, the stage to build (default: this rank's; with several
    stages a rank, each is built by a call of its own and joined, ``_rank_stages``).
    """
    p = mesh.parallel
    if p.pp > 1 and p.pp_stages_per_rank > 1 and stage_index is None:
        return _rank_stages(model_path, mesh, (seed, mp_policy, lora_config, frozen_dtype, train_towers))
    model = build_meta_model(model_path)
    if not train_towers:
        for name in tower_parameters(model):
            model.get_parameter(name).requires_grad_(False)
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    plan = infer_plan(model, mesh.parallel.tp)
    plan, stage, peft_cfg, adapters = _stage_and_adapters(model, mesh, plan, lora_config, stage_index)
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
    if mesh.parallel.cp > 1:  # attention over the sequence split between the cp ranks
        check_context_parallel(model, mesh.parallel.cp, mesh.parallel.cp_attention, mesh.parallel.tp)
        enable_context_parallel(model)
    placements = tp_placements(model)  # as the styles placed them: FSDP's and to_empty's are new tensors (PartsShard)
    if mesh.shards_parameters:
        # under pp the stage is FSDP's root: its forward unshards what the stage holds outside the blocks,
        # and torch's schedules then reduce the gradients once per step (``PipelineStage`` knows FSDPModule)
        ignored = {model.get_parameter(n) for n in experts} | held_nothing(model)
        apply_fsdp(stage if stage is not None else model, mesh, mp_policy, ignored)
    _materialize(model, mesh)
    keep_placements(model, placements)
    with torch.no_grad():
        restore_buffers(model, buffers)
    if has_weights(model_path):
        load_hf_weights(model, model_path)
    else:
        init_from_seed(model, model_path, seed)
    if lora_config is not None:
        lora.copy_modules_to_save(model)
        if lora_config.adapter:
            lora.load_adapter(model, lora_config.adapter, adapters)
        else:
            lora.init_adapters(model, seed, adapters)
    _buffers_to(model, mesh.device)
    model.train()
    tp_on = mesh.parallel.tp > 1
    partial = tp_partial_grad_params(
        model, plan, with_lora=lora_config is not None and tp_on, sequence_parallel=mesh.parallel.sequence_parallel
    )
    fsdp_on = mesh.shards_parameters and mp_policy is not None
    dtype = mp_policy.param_dtype if fsdp_on else None
    experts_group = mesh.expert_dp_group if experts else None
    return ParallelModel(model, plan, partial, dtype, peft_cfg, experts, experts_group, stage)
