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

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from shardlm.errors import ConfigError
from shardlm.mesh import Mesh
from shardlm.plan import infer_tp_plan
from shardlm.styles import make_style


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

    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(_load_config(model_path))
    return model.float()


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks: the longest ModuleList whose children share one class."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            if len({type(m) for m in module}) == 1:
                best = list(module)
    return best


def apply_tp(model: nn.Module, mesh: Mesh, plan: dict[str, str]) -> None:
    """Apply the plan on the TP mesh; keep tied input/output embeddings tied."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    parallelize_module(model, mesh.tp, {fqn: make_style(s) for fqn, s in plan.items()}, src_data_rank=None)
    if tied:
        # both sides shard the vocabulary dimension (Shard(0)), so one DTensor serves both
        head.weight = emb.weight


def apply_fsdp(model: nn.Module, mesh: Mesh, mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """FSDP2 over the data-parallel mesh: one group per decoder block, the rest at the root.

    Gradients are summed, not averaged, across data-parallel ranks (divide factor 1): the loss is
    already normalized by the global token count, see ``loss.py``.
    """
    kwargs = {"mesh": mesh.dp, "mp_policy": mp_policy or MixedPrecisionPolicy()}
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


def load_hf_weights(model: nn.Module, model_path: str) -> None:
    """Read safetensors shard by shard into the local pieces of every (D)Tensor (DCP's HF reader)."""
    reader = HuggingFaceStorageReader(model_path)
    available = set(reader.read_metadata().state_dict_metadata)
    state = model.state_dict()
    tied = {k for k, v in state.items() for k2, v2 in state.items() if k != k2 and v is v2}
    missing = [k for k in state if k not in available and k not in tied]
    if missing:
        raise ConfigError(f"model: '{model_path}' lacks weights for {missing[0]} (and {len(missing) - 1} more)")
    dcp.load({k: v for k, v in state.items() if k in available}, storage_reader=reader)


def init_from_seed(model: nn.Module, model_path: str, seed: int) -> None:
    """Random init that is identical for every layout: rank 0 builds the full model from the
    seed, exactly as one process would, and every rank takes its shard of the broadcast."""
    full = {}
    if dist.get_rank() == 0:
        full = reference_model(model_path, seed).state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def reference_model(model_path: str, seed: int) -> nn.Module:
    """The plain one-process model shardlm starts from (also what tests compare against)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_load_config(model_path)).float()


def has_weights(model_path: str) -> bool:
    return bool(glob.glob(os.path.join(model_path, "*.safetensors")))


def parallelize(
    model_path: str, mesh: Mesh, seed: int = 0, mp_policy: MixedPrecisionPolicy | None = None
) -> nn.Module:
    """Build, parallelize and fill the model at ``model_path`` for ``mesh``."""
    model = build_meta_model(model_path)
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    if mesh.parallel.tp > 1:
        apply_tp(model, mesh, infer_tp_plan(model, mesh.parallel.tp))
    if mesh.parallel.dp_size > 1:
        apply_fsdp(model, mesh, mp_policy)
    shared = _shared_parameters(model)
    model.to_empty(device=mesh.device)
    _retie(shared)
    with torch.no_grad():
        _restore_buffers(model, buffers)
    if has_weights(model_path):
        load_hf_weights(model, model_path)
    else:
        init_from_seed(model, model_path, seed)
    model.train()
    return model
