"""Optimizer and learning-rate schedule from the ``train`` config.

* ``optim: adamw``: ``torch.optim.AdamW`` with ``foreach=True`` on CPU (one multi-tensor kernel
  per update op instead of a Python loop over parameters) and ``fused=True`` on CUDA.
* ``optim: sgd``: ``torch.optim.SGD`` with ``sgd_momentum``, ``foreach=True``.

Both step on local shards (``LocalShardAdamW``, ``LocalShardSGD``): the update is elementwise, so a
rank's piece of each parameter, gradient and state tensor is all the update needs, and the numbers
are the same kernels on the same values as the update over the whole tensor. Stepping DTensors
instead sends every ``_foreach_*`` op (a dozen per AdamW step) through DTensor's Python dispatch,
which measured 3-6% of a tp=2 step (benchmarks/README.md). Parameters and state stay DTensors (FSDP,
clipping and DCP checkpoints need their placements); only the lists handed to torch's functional
``adamw`` / ``sgd`` hold their local tensors. A group where some gradient or state tensor does not
have its parameter's placements (none in shardlm today) steps as DTensors, as before.

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
from torch.optim.sgd import sgd

from shardlm.config import Config


def _mesh_key(param: torch.Tensor) -> object:
    """Parameters on different device meshes (or plain and DTensor) stay in separate groups, so the
    DTensor fallback of ``local_views`` never mixes meshes in one foreach call. Compared by value:
    FSDP2 over TP gives each parameter an equal but separate mesh object."""
    return param.device_mesh if isinstance(param, DTensor) else None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay / no-decay groups (1-D parameters get no decay); split further only if parameters
    live on more than one mesh."""
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


def _layout(t: torch.Tensor | None) -> object:
    return (t.device_mesh, t.placements, t.shape) if isinstance(t, DTensor) else None


def local_views(params: list[torch.Tensor], *per_param: list) -> bool:
    """Replace, in place, each DTensor of ``params`` and of the parallel lists ``per_param`` (its
    gradient, its state tensors; None for state not made yet) by its local tensor, which shares
    its storage, so in-place updates land in the DTensor. Only if every tensor of a row has its
    parameter's mesh, placements and shape; otherwise nothing changes and the group steps as
    DTensors. Whether the lists were changed."""
    rows = list(zip(params, *per_param, strict=True))
    if not any(isinstance(p, DTensor) for p in params):
        return False
    if any(_layout(t) != _layout(row[0]) for row in rows for t in row if t is not None):
        return False
    for values in (params, *per_param):
        values[:] = [t.to_local() if isinstance(t, DTensor) else t for t in values]  # no_grad: the tensor itself
    return True


def _as_param_dtensor(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``param``'s mesh, placements and shape (no copy); a plain
    parameter's tensor as it is."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


class LocalShardAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose update runs on each rank's local pieces (module docstring).
    torch's own ``step`` collects the group's tensors through ``_init_group`` (creating the state
    as DTensors like the parameters) and hands the lists to the functional ``adam``: only the lists
    change here."""

    def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        has_complex = super()._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        state = [exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if group["amsgrad"] else [])
        local_views(params, grads, *state)
        return has_complex


class LocalShardSGD(torch.optim.SGD):
    """``torch.optim.SGD`` whose update runs on each rank's local pieces (module docstring). Its
    ``step`` is torch's with one difference: ``sgd`` creates a missing momentum buffer from the
    gradient it is given, a local tensor here, so the new buffer is wrapped back as a DTensor with
    its parameter's placements before it is stored in the state."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            has_sparse_grad = self._init_group(group, params, grads, buffers)
            views, stored, momentum = list(params), list(buffers), group["momentum"] != 0
            local = local_views(views, grads, *([buffers] if momentum else []))
            sgd(
                views,
                grads,
                buffers,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                has_sparse_grad=has_sparse_grad,
                foreach=group["foreach"],
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
            )
            if momentum:
                for p, old, buf in zip(params, stored, buffers, strict=True):
                    if local:  # an existing buffer was updated in place; a new one is wrapped
                        buf = old if old is not None else _as_param_dtensor(buf, p)
                    self.state[p]["momentum_buffer"] = buf
        return loss


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The optimizer of ``train.optim`` over the trainable parameters of ``model``."""
    t = cfg.train
    groups = param_groups(model, t.weight_decay)
    on_cuda = any(p.device.type == "cuda" for g in groups for p in g["params"])
    if t.optim == "sgd":
        return LocalShardSGD(groups, lr=t.learning_rate, momentum=t.sgd_momentum, foreach=True)
    kernel = {"fused": True} if on_cuda else {"foreach": True}
    return LocalShardAdamW(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, **kernel)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LRScheduler:
    """HF schedule ``train.lr_scheduler_type`` with ``warmup_steps``, ending at ``max_steps``."""
    from transformers import get_scheduler

    t = cfg.train
    name = {"constant": "constant_with_warmup"}.get(t.lr_scheduler_type, t.lr_scheduler_type)
    return get_scheduler(name, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps)
