"""The flags of ``shardlm estimate`` checked as the config keys they stand for would be, before the model is
read or planned where possible: one ``ConfigError`` line naming the flag and the fix."""

from __future__ import annotations

from torch import nn

from shardlm.config import ParallelConfig
from shardlm.config.ranges import check_value, check_world
from shardlm.errors import ConfigError
from shardlm.parallel.model.geometry import read_geometry
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.sequence import sequence_refusal
from shardlm.parallel.runtime.ulysses import ATTENTION as ULYSSES
from shardlm.parallel.runtime.ulysses import ulysses_refusal


def check_sequence_parallel(model: nn.Module, plan: Plan, tp: int, seq: int, cp: int) -> None:
    """``--sequence-parallel`` as ``parallel.sequence_parallel`` is checked (``config/load.py``, preflight):
    it slices a rank's ``seq / cp`` tokens over tp."""
    if tp == 1 or (seq // cp) % tp:
        held = f"--seq {seq}" if cp == 1 else f"--seq / --cp = {seq // cp}"
        raise ConfigError(f"--sequence-parallel splits the sequence over --tp: needs --tp > 1 dividing {held}")
    why = sequence_refusal(model, plan)
    if why is not None:
        raise ConfigError(f"--sequence-parallel cannot run this model: {why}")


def check_layout(
    tp: int,
    fsdp: int,
    dp_replicate: int,
    batch: int,
    seq: int,
    ep: int,
    lora_r: int | None,
    memory_gib: float | None,
    cp: int = 1,
) -> None:
    """The layout ``estimate`` is asked about, checked before the model is read (one ``ConfigError``
    line): each flag against the range of the config key it stands for (``config/ranges.py``)."""
    for flag, key, value in (
        ("--tp", "parallel.tp", tp),
        ("--fsdp", "parallel.fsdp", fsdp),
        ("--dp-replicate", "parallel.dp_replicate", dp_replicate),
        ("--batch", "train.per_device_train_batch_size", batch),
        ("--seq", "data.seq_len", seq),
        ("--ep", "parallel.ep", ep),
        ("--cp", "parallel.cp", cp),
    ):
        check_value(key, value, flag)
    check_world(tp * cp, fsdp, dp_replicate, "--dp-replicate x --fsdp x --cp x --tp")
    if seq % (2 * cp):
        raise ConfigError(f"--seq {seq} must be a multiple of 2 x --cp = {2 * cp}: each window is cut in 2*cp chunks")
    if not ParallelConfig(tp, fsdp, dp_replicate, ep, cp=cp).ep_fits:
        raise ConfigError(
            f"--ep {ep} must divide --fsdp x --cp = {fsdp * cp} or be a multiple of it dividing --dp-replicate x "
            "--fsdp x --cp: expert-parallel ranks are carved out of the data- and context-parallel ranks"
        )
    if lora_r is not None and lora_r < 1:
        raise ConfigError(f"--lora-r must be >= 1, got {lora_r}")
    if memory_gib is not None and memory_gib <= 0:
        raise ConfigError(f"--memory must be a positive number of GiB, got {memory_gib}")


def check_cp_attention(model: nn.Module, cp: int, cp_attention: str, tp: int) -> None:
    """``--cp-attention`` as ``parallel.cp_attention`` would take it (``parallel/runtime/ulysses.py``)."""
    if cp_attention not in ParallelConfig.CP_ATTENTIONS:
        raise ConfigError(
            f"--cp-attention must be one of {', '.join(ParallelConfig.CP_ATTENTIONS)}, got '{cp_attention}'"
        )
    geometry = read_geometry(model.config.get_text_config())
    why = ulysses_refusal(geometry.heads or 0, geometry.kv or 0, tp, cp) if cp_attention == ULYSSES else None
    if why is not None:
        raise ConfigError(f"--cp-attention {ULYSSES} at --cp {cp}: {why}; use --cp-attention all_gather")


def check_offload(fsdp_offload: bool, dp_size: int, ep: int) -> None:
    """``--fsdp-offload`` where ``parallel.fsdp_offload=cpu`` would be refused (``config/load.py``)."""
    if fsdp_offload and dp_size == 1:
        raise ConfigError("--fsdp-offload offloads FSDP's shards: it needs --fsdp or --dp-replicate > 1")
    if fsdp_offload and ep > 1:
        raise ConfigError("--fsdp-offload with --ep > 1 is not supported: the experts are outside FSDP")
