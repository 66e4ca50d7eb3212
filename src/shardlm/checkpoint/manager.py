"""Saving and resuming a run: DCP shards of model + optimizer, and the rest of the run state.

A checkpoint holds the explicit components of ``TrainState`` (as torchtitan's checkpointer takes
its ``states``), never a Trainer: model and optimizer state as DCP shards keyed by parameter FQN
(``get_state_dict``), so any layout can load them (DCP reshards DTensors; each rank writes and
reads only its own boxes, a packed projection's parts included, ``distributed/shards.py``); each rank's RNG
states under ``rng/``; and in the marker (``layout.py``) the step (= data position, the order
being f(seed, global batch)), global batch, seed, data size, scheduler state, layout, LoRA
config and the resolved run config. LoRA runs save only what trains; the frozen base is re-read
from the base model on resume.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from peft import LoraConfig as PeftLoraConfig
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardlm.checkpoint.io import load_dcp, read_metadata
from shardlm.checkpoint.layout import (
    FORMAT_VERSION,
    MARKER_FILES,
    checkpoints_dir,
    copy_hf_files,
    finalize,
    find_latest,
    prune,
    read_marker,
    remove_leftovers,
    resolve,
    write_proof,
)
from shardlm.checkpoint.manifest import check_model, verify
from shardlm.config import Config
from shardlm.distributed.shards import PackedShards, SavePlanner, keep_placements_in, packed_view, tp_placements
from shardlm.errors import ConfigError, OutOfSpace

log = logging.getLogger("shardlm")

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

VERIFIED_ENV = "SHARDLM_VERIFIED_CHECKPOINT"

LORA_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


@dataclass
class TrainState:
    """What a checkpoint saves and restores besides the global RNG: explicit objects, no Trainer.

    ``lora``: the peft config of a LoRA run (only what trains is saved), None otherwise.
    ``num_samples``: the size of the training set (a resume with other data is refused).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    num_samples: int
    lora: PeftLoraConfig | None = None

    def options(self) -> StateDictOptions:
        return LORA_OPTIONS if self.lora is not None else OPTIONS

    def state_dicts(self) -> tuple[dict, dict]:
        """Model and optimizer state to save or fill. In a LoRA run only what trains: torch's
        ``ignore_frozen_params`` misses the second name of a tied frozen weight (GPT-2's lm_head)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options())
        placements = tp_placements(self.model)  # positions DTensor ops may have changed (``shards.PartsShard``)
        keep_placements_in(model_sd, placements)
        keep_placements_in(optim_sd, placements)
        if self.lora is not None:
            trains = {n for n, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in trains}
        return model_sd, optim_sd

    def lora_marker(self) -> dict | None:
        """What the marker records of a LoRA run: the peft config (``export`` writes it out)."""
        return None if self.lora is None else json.loads(json.dumps(self.lora.to_dict(), default=list))


# ---------------------------------------------------------------- saving


def _broadcast_str(value: str) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _bytes(state_dict: dict) -> int:
    """Bytes of the tensors of a state dict at their global shapes (DTensors whole)."""
    return sum(v.numel() * v.element_size() for v in state_dict.values() if isinstance(v, torch.Tensor))


def _disk_full(exc: BaseException) -> bool:
    """``exc`` is, wraps or was caused by ENOSPC (DCP wraps each rank's write error)."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if isinstance(e, CheckpointException):
            todo.extend(pair[0] if isinstance(pair, tuple) else pair for pair in e.failures.values())
        todo.extend((e.__cause__, e.__context__))
    return False


def _zip_writer_full(exc: BaseException, folder: str, needed: int) -> bool:
    """torch.save's zip writer reports a full disk as "unexpected pos", not ENOSPC: that message on
    a disk with less free space than the checkpoint needs (any other error is raised as it is)."""
    if "unexpected pos" not in str(exc):
        return False
    try:
        return shutil.disk_usage(folder).free < needed
    except OSError:
        return False


def out_of_space(path: str, needed: int) -> OutOfSpace:
    """The one line for a save that filled the disk: where, about how much it needed, how much is free."""
    free = shutil.disk_usage(os.path.dirname(os.path.normpath(path))).free
    return OutOfSpace(
        f"no space left on device writing {path}: it needs about {needed / 1e6:.1f} MB, "
        f"{free / 1e6:.1f} MB are free there; free some space or set another train.output_dir"
    )


def save_checkpoint(state: TrainState, cfg: Config, step: int) -> str:
    """Collective: every rank writes its shards of model, optimizer and RNG into ``step-{step}``.

    A save that fills the disk removes its ``.tmp-`` directory and raises ``OutOfSpace`` naming
    the path and about how much space the checkpoint needs (model + optimizer state, global)."""
    t = cfg.train
    rank, start = dist.get_rank(), time.perf_counter()
    final = os.path.join(checkpoints_dir(t.output_dir), f"step-{step}")
    tmp = _broadcast_str(f"{final}.tmp-{uuid.uuid4().hex[:8]}" if rank == 0 else "")
    model_sd, optim_sd = state.state_dicts()
    needed = _bytes(model_sd) + _bytes(optim_sd)
    try:
        if rank == 0:
            remove_leftovers(t.output_dir)  # a dead save (on a full disk: the space this one needs)
            os.makedirs(os.path.join(tmp, "rng"))
            copy_hf_files(cfg, os.path.join(tmp, "hf"))
        dist.barrier()
        dcp.save(
            {"model": packed_view(model_sd), "optim": packed_view(optim_sd)},
            storage_writer=FileSystemWriter(tmp),
            planner=SavePlanner(),
        )
        save_file(_rng_state(), os.path.join(tmp, "rng", f"rank{rank}.safetensors"))
        dist.barrier()
        if rank == 0:
            finalize(tmp, final, write_proof(tmp, _marker(state, cfg, step), cfg.model))
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        if not (_disk_full(exc) or _zip_writer_full(exc, os.path.dirname(final), needed)):
            raise
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise out_of_space(final, needed) from None
    if rank == 0:
        prune(t.output_dir, t.save_total_limit, final)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(final) for f in fs)
        print(f"saved {final} ({size / 1e6:.1f} MB in {time.perf_counter() - start:.2f} s)", flush=True)
    dist.barrier()
    return final


MARKER_LAYOUT = ("tp", "fsdp", "dp_replicate", "ep", "pp", "cp", "sequence_parallel")  # what the resume message names


def _marker(state: TrainState, cfg: Config, step: int) -> dict:
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "samples_seen": step * cfg.global_batch_size,
        "global_batch_size": cfg.global_batch_size,
        "seed": cfg.train.seed,
        "num_samples": state.num_samples,
        "world_size": dist.get_world_size(),
        "layout": {k: getattr(cfg.parallel, k) for k in MARKER_LAYOUT},
        "lora": state.lora_marker(),
        "scheduler": state.scheduler.state_dict(),
        "config": cfg.to_dict(),
    }


# ---------------------------------------------------------------- resuming


# what a resume takes from the checkpoint whatever the config says: the optimizer's hyperparameters
# (torch's ``Optimizer.load_state_dict`` restores its param groups) and the schedule's base learning
# rate (``LRScheduler.load_state_dict`` restores ``base_lrs``); the schedule's shape is rebuilt
RESTORED_KEYS = ("optim", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "sgd_momentum")


def check_compatible(step_dir: str, marker: dict, cfg, num_samples: int | None = None) -> None:
    """Refuse a resume that would silently change the data order (global batch, seed, data) or
    silently ignore a configured optimizer value (``RESTORED_KEYS``)."""
    saved_data = marker.get("config", {}).get("data", {})
    if saved_data.get("packing") and cfg.data.packing:
        strategy = saved_data.get("packing_strategy", "wrapped")  # what a checkpoint older than the key packed
        if strategy != cfg.data.packing_strategy:
            raise ConfigError(
                f"data.packing_strategy: '{step_dir}' was trained on '{strategy}' windows but this run packs "
                f"'{cfg.data.packing_strategy}'; the data would change: set data.packing_strategy: {strategy}"
            )
    saved = marker.get("config", {}).get("train", {})
    for key in RESTORED_KEYS:
        if key in saved and saved[key] != getattr(cfg.train, key):
            raise ConfigError(
                f"train.{key}: {getattr(cfg.train, key)} differs from the checkpoint's {saved[key]}, which a resume "
                f"would keep ('{step_dir}' restores the optimizer and its learning rate); set it back, or start a "
                "fresh run with train.overwrite_output_dir=true"
            )
    if marker["global_batch_size"] != cfg.global_batch_size:
        raise ConfigError(
            f"train.resume: '{step_dir}' was trained with global batch {marker['global_batch_size']} but this run has "
            f"{cfg.global_batch_size} (per_device_train_batch_size x dp x gradient_accumulation_steps); make them equal"
        )
    if marker["seed"] != cfg.train.seed:
        raise ConfigError(f"train.seed: {cfg.train.seed} differs from the checkpoint's {marker['seed']}; set it back")
    if num_samples is not None and marker["num_samples"] != num_samples:
        raise ConfigError(
            f"data.path: the dataset has {num_samples} samples but '{step_dir}' was trained on "
            f"{marker['num_samples']}; the data order would change, resume with the same data"
        )


def precheck_resume(cfg: Config) -> str | None:
    """Before spawning: the checkpoint ``train.resume`` names exists, is complete, has the bytes its
    manifest recorded, was saved from this model and fits this run; returns it (None: none to resume)."""
    t = cfg.train
    if t.resume is False or t.resume is None:
        return None
    step_dir = find_latest(t.output_dir) if t.resume is True else resolve(str(t.resume), "train.resume")
    if step_dir is not None:
        marker = read_marker(step_dir)
        check_model(step_dir, verify(step_dir, marker, MARKER_FILES), cfg.model, "train.resume")
        check_compatible(step_dir, marker, cfg)
    return step_dir


def verify_collective(step_dir: str, marker: dict) -> None:
    """Collective: rank 0 checks ``step_dir`` against its manifest (``manifest.verify``), every rank
    raises the same ConfigError if it fails. Skipped when the launcher verified it already
    (the CLI sets ``SHARDLM_VERIFIED_CHECKPOINT`` after ``precheck_resume``; the spawned ranks inherit it)."""
    if os.environ.get(VERIFIED_ENV) == os.path.realpath(step_dir):
        return
    problem = ""
    if dist.get_rank() == 0:
        try:
            verify(step_dir, marker, MARKER_FILES)
        except ConfigError as exc:
            problem = str(exc)
    problem = _broadcast_str(problem)
    if problem:
        raise ConfigError(problem)


def _check_shapes(step_dir: str, metadata: Metadata, model_sd: dict) -> None:
    """Every model tensor must exist in the checkpoint with the same global shape."""
    saved = metadata.state_dict_metadata
    for name, tensor in model_sd.items():
        item = saved.get(f"model.{name}")
        if not isinstance(item, TensorStorageMetadata):
            raise ConfigError(f"train.resume: '{step_dir}' has no weight '{name}'; it was saved from another model")
        if tuple(item.size) != tuple(tensor.shape):
            raise ConfigError(
                f"train.resume: '{step_dir}' holds '{name}' as {list(item.size)} but 'model' has "
                f"{list(tensor.shape)}; it was saved from another model"
            )


def _restore_rng(step_dir: str, saved_world: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != saved_world and rank == 0:
        log.info(
            "checkpoint saved by %d ranks, resuming on %d: rank r takes RNG of rank r %% %d",
            saved_world,
            world,
            saved_world,
        )
    path = os.path.join(step_dir, "rng", f"rank{rank % saved_world}.safetensors")
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint '{step_dir}': '{path}' is missing")
    state = load_file(path)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _check_lora(step_dir: str, marker: dict, mine: dict | None) -> None:
    """A LoRA checkpoint resumes only a LoRA run with the same adapter shapes, and vice versa."""
    saved = marker.get("lora")
    if bool(saved) != bool(mine):
        what = "a LoRA run" if saved else "a full fine-tuning run"
        fix = "add the same 'lora' section" if saved else "remove the 'lora' section"
        raise ConfigError(f"train.resume: '{step_dir}' is from {what}; {fix} to resume it")
    if saved:
        for key in ("r", "lora_alpha", "target_modules", "modules_to_save"):
            a, b = saved.get(key), mine.get(key)
            if (sorted(a) if isinstance(a, list) else a) != (sorted(b) if isinstance(b, list) else b):
                raise ConfigError(f"lora: {key} is {b!r} but '{step_dir}' was trained with {a!r}; set it back")


def fit_groups(scheduler_state: dict, groups: int) -> dict:
    """The scheduler's state for an optimizer of ``groups`` parameter groups. Its per-group lists
    (``base_lrs``, the last lrs, the lambdas' state) hold one value repeated (one learning rate,
    one schedule), but the number of groups depends on the layout: parameters on different meshes
    cannot share a multi-tensor kernel (the experts under EP, ``train/optim.py``), so the lists
    are cut or repeated to the optimizer's."""
    saved = len(scheduler_state.get("lr_lambdas") or [])
    if saved in (0, groups):
        return scheduler_state
    return {k: [v[0]] * groups if isinstance(v, list) and len(v) == saved else v for k, v in scheduler_state.items()}


def load_checkpoint(state: TrainState, cfg: Config, step_dir: str) -> dict:
    """Collective: restore model, optimizer, scheduler and RNG from ``step_dir`` (any layout).

    Returns the marker; its ``step`` is where training continues."""
    marker = read_marker(step_dir)
    verify_collective(step_dir, marker)
    check_compatible(step_dir, marker, cfg, state.num_samples)
    _check_lora(step_dir, marker, state.lora_marker())
    metadata = read_metadata(step_dir)
    model_sd, optim_sd = state.state_dicts()
    _check_shapes(step_dir, metadata, model_sd)
    loaded = {"model": packed_view(model_sd), "optim": packed_view(optim_sd)}
    load_dcp(loaded, step_dir)  # tensors in place; non-tensor entries (lr, betas) replaced in ``loaded``
    for section, target in (("model", model_sd), ("optim", optim_sd)):
        for key, value in loaded[section].items():
            if not isinstance(value, PackedShards):
                target[key] = value
    set_state_dict(
        state.model, state.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=state.options()
    )
    state.scheduler.load_state_dict(fit_groups(marker["scheduler"], len(state.optimizer.param_groups)))
    state.scheduler.last_epoch -= 1  # recompute this step's lr: same value, or the new schedule's
    state.scheduler.step()  # if train.max_steps changed on resume
    _restore_rng(step_dir, marker["world_size"])
    return marker


def maybe_resume(state: TrainState, cfg: Config) -> dict | None:
    """Apply ``train.resume``: ``true`` -> newest complete checkpoint of output_dir (none: start
    fresh), a path -> that checkpoint. Returns the marker resumed from, or None."""
    t = cfg.train
    if t.resume is False or t.resume is None:
        return None
    if t.resume is True:
        found = find_latest(t.output_dir) if dist.get_rank() == 0 else None
        step_dir = _broadcast_str(found or "") or None
        if step_dir is None:
            if dist.get_rank() == 0:
                print(f"resume: no complete checkpoint in {checkpoints_dir(t.output_dir)}; starting fresh", flush=True)
            return None
    else:
        step_dir = resolve(str(t.resume), "train.resume")
    marker = load_checkpoint(state, cfg, step_dir)
    if dist.get_rank() == 0:
        saved = ", ".join(f"{k}={v}" for k, v in marker["layout"].items())
        print(f"resumed from {step_dir} at step {marker['step']} (saved with {saved})", flush=True)
    return marker
