"""Optimizer and learning-rate schedule from the ``train`` config.

* ``optim: adamw``: ``torch.optim.AdamW`` with ``foreach=True`` on CPU (one multi-tensor kernel
  per update op instead of a Python loop over parameters) and ``fused=True`` on CUDA. Both run
  on DTensor parameters: torch registers the ``_foreach_*`` and ``_fused_adamw_`` ops with
  DTensor as list-pointwise ops, each tensor keeping its own placements.
* ``optim: sgd``: ``torch.optim.SGD`` with ``sgd_momentum``, ``foreach=True``.

Weight decay applies to matrices only: 1-D parameters (norm weights, biases) form a group with
``weight_decay=0``, as in the HF Trainer. Optimizer state lives next to each parameter, so it has
the parameter's placement and dtype: fp32 master state also under ``bf16`` (see ``train/trainer.py``).

Schedules are the HF ones (``transformers.get_scheduler``): ``constant`` (after warmup),
``linear`` and ``cosine`` decay to 0 at ``max_steps``, each with ``warmup_steps`` of linear warmup.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardlm.config import Config


def _mesh_key(param: torch.Tensor) -> object:
    """Parameters on different device meshes (or plain and DTensor) cannot share a foreach call.
    Compared by value: FSDP2 over TP gives each parameter an equal but separate mesh object."""
    return param.device_mesh if isinstance(param, DTensor) else None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay / no-decay groups (1-D parameters get no decay); split further only if parameters
    live on more than one mesh, which a multi-tensor kernel cannot mix."""
    groups: dict[tuple, dict] = {}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        decay = param.ndim >= 2
        key = (not decay, _mesh_key(param))
        groups.setdefault(key, {"params": [], "weight_decay": weight_decay if decay else 0.0})["params"].append(param)
    meshes = {k[1] for k in groups}
    if len(meshes) == 1:  # the usual case: two groups, as many as a one-process run has (resume across layouts)
        return [groups[k] for k in sorted(groups, key=lambda k: k[0])]
    return list(groups.values())


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The optimizer of ``train.optim`` over the trainable parameters of ``model``."""
    t = cfg.train
    groups = param_groups(model, t.weight_decay)
    on_cuda = any(p.device.type == "cuda" for g in groups for p in g["params"])
    if t.optim == "sgd":
        return torch.optim.SGD(groups, lr=t.learning_rate, momentum=t.sgd_momentum, foreach=True)
    kernel = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(
        groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, **kernel
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LRScheduler:
    """HF schedule ``train.lr_scheduler_type`` with ``warmup_steps``, ending at ``max_steps``."""
    from transformers import get_scheduler

    t = cfg.train
    name = {"constant": "constant_with_warmup"}.get(t.lr_scheduler_type, t.lr_scheduler_type)
    return get_scheduler(name, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps)
