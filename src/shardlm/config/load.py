"""Reading the run configuration: YAML file + dotted ``KEY=VALUE`` overrides -> checked dataclasses.

Every value check that needs no model is here (unknown keys, types, ranges, paths), so bad input
fails before any rank is spawned; the model-aware checks are ``shardlm.preflight``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
from dataclasses import fields
from typing import Any

import yaml

from shardlm.config.paths import check_model_dir, check_output_dir
from shardlm.config.ranges import check_ranges
from shardlm.config.schema import (
    PP_MULTI_STAGE,
    SCHEDULERS,
    Config,
    DataConfig,
    EvalConfig,
    ParallelConfig,
    TrainConfig,
)
from shardlm.errors import ConfigError


def _build(cls: type, values: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from a mapping, refusing unknown keys and wrong types by name."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        where = f"'{prefix.rstrip('.')}'" if prefix else "the config"
        raise ConfigError(f"{where} must be a mapping of keys, got {values!r}")
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"unknown config key '{name}'; valid keys here: {', '.join(known)}")
        f = known[key]
        if "section" in f.metadata:  # an optional section (``lora``): absent or null means off
            kwargs[key] = None if value is None else _build(f.metadata["section"], value, f"{name}.")
        elif dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            kwargs[key] = _build(f.default_factory, value, f"{name}.")
        else:
            kwargs[key] = _coerce(f, value, name)
    return cls(**kwargs)


def _coerce(f: dataclasses.Field, value: Any, name: str) -> Any:
    """Check a leaf value against the field's declared type (ints accept whole floats, floats ints).

    A number written as a string is accepted: PyYAML reads ``1e-4`` (no dot) as the string "1e-4",
    which every user means as the float; a string that does not parse as a number is refused."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"config key '{name}' must not be null")
    if kind.startswith(("int", "float")) and isinstance(value, str):
        value = _number(value, value)
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _whole(value):
            raise ConfigError(f"config key '{name}' must be an integer, got {value!r}")
        return int(value)
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{name}' must be a number, got {value!r}")
        return float(value)
    if kind == "bool" and not isinstance(value, bool):
        raise ConfigError(f"config key '{name}' must be true or false, got {value!r}")
    if kind.startswith("str") and not isinstance(value, str):
        raise ConfigError(f"config key '{name}' must be a string, got {value!r}")
    return value


def _number(text: str, default: Any) -> Any:
    """``text`` as a float when it is one ("1e-4", "3E5"), else ``default`` (left for the type check)."""
    try:
        return float(text.strip())
    except ValueError:
        return default


def _whole(value: float) -> bool:
    return math.isfinite(value) and int(value) == value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings to a nested dict; values are parsed as YAML scalars."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like KEY=VALUE, e.g. parallel.tp=2")
        key, _, text = item.partition("=")
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if node.get(part) is None:  # absent, or an empty section (``data:`` with nothing under it)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"override '{item}': the value is not valid YAML; put it in YAML quotes") from None
    return raw


def load_config(path: str | None = None, overrides: list[str] | None = None, raw: dict | None = None) -> Config:
    """Read a YAML file (or take ``raw``), apply overrides, build and validate the config."""
    if raw is None:
        if path is None or not os.path.isfile(path):
            raise ConfigError(f"config file '{path}' not found; pass the path of a YAML config")
        with open(path) as fh:
            try:
                raw = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                line = getattr(getattr(exc, "problem_mark", None), "line", None)
                where = f" at line {line + 1}" if line is not None else ""
                raise ConfigError(f"config file '{path}' is not valid YAML{where}") from None
    if not isinstance(raw, dict):
        where = f"config file '{path}'" if path else "the config"
        raise ConfigError(f"{where} must be a mapping of keys (model, data, parallel, train)")
    raw = apply_overrides(copy.deepcopy(raw), overrides or [])  # the caller's ``raw`` stays as it was
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks of values and paths alone (those that need the model: ``shardlm.preflight``)."""
    t = cfg.train
    check_ranges(cfg)  # every numeric key against its rule (``ranges.RULES``)
    _validate_ep(cfg)
    _validate_sequence_parallel(cfg)
    _validate_offload(cfg)
    _validate_pp(cfg)
    _validate_cp(cfg)
    _validate_compile(t, cfg.parallel)  # after pp and cp, which refuse it by name
    d = cfg.data
    if d.packing_strategy not in d.PACKING_STRATEGIES:
        names = " or ".join(d.PACKING_STRATEGIES)
        raise ConfigError(f"data.packing_strategy must be {names}, got '{d.packing_strategy}'")
    if t.lr_scheduler_type not in SCHEDULERS:
        names = ", ".join(SCHEDULERS)
        raise ConfigError(f"train.lr_scheduler_type must be one of {names}, got '{t.lr_scheduler_type}'")
    check_model_dir(cfg.model)
    cfg.data.check()
    check_output_dir(t.output_dir)
    _validate_checkpointing(t)
    _validate_training(t, cfg.eval)


def _validate_ep(cfg: Config) -> None:
    """Expert-parallel ranks are carved out of the data- and context-parallel ranks, ``fsdp x cp``
    first (``distributed/mesh.py``): ``ep`` must divide ``fsdp x cp``, or be a multiple of it dividing
    ``dp_replicate x fsdp x cp``; what the model decides (its expert count) is checked by ``shardlm.preflight``."""
    p = cfg.parallel
    if not p.ep_fits:
        inner, tokens = ("parallel.fsdp", "dp_replicate*fsdp") if p.cp == 1 else ("fsdp*cp", "dp_replicate*fsdp*cp")
        raise ConfigError(
            f"parallel.ep={p.ep} must divide {inner}={p.fsdp * p.cp} or be a multiple of it dividing "
            f"{tokens}={p.dp_size * p.cp}: expert-parallel ranks are carved out of the data- and "
            f"context-parallel ranks; set parallel.fsdp, parallel.cp or parallel.dp_replicate so that {p.ep} ranks "
            "can be taken"
        )


def _validate_sequence_parallel(cfg: Config) -> None:
    """Sequence parallelism splits the sequence over the TP ranks: it needs ``tp`` > 1 and
    ``data.seq_len`` divisible by it (what the model decides: ``shardlm.preflight``)."""
    p, seq = cfg.parallel, cfg.data.seq_len
    if not p.sequence_parallel:
        return
    if p.tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel=true splits the sequence over the tensor-parallel ranks, but parallel.tp=1; "
            "set parallel.tp to 2 or more, or parallel.sequence_parallel=false"
        )
    if seq % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true needs data.seq_len={seq} divisible by parallel.tp={p.tp}: "
            f"set data.seq_len to a multiple of {p.tp}"
        )


def _validate_offload(cfg: Config) -> None:
    """``parallel.fsdp_offload`` (``parallel/build.py: apply_fsdp``): FSDP2 offloads the shards it
    owns, so there must be FSDP (a data-parallel mesh); the experts under EP are outside FSDP and
    would stay on the device."""
    p = cfg.parallel
    if p.fsdp_offload not in p.OFFLOADS:
        raise ConfigError(f"parallel.fsdp_offload must be one of {', '.join(p.OFFLOADS)}, got '{p.fsdp_offload}'")
    if p.fsdp_offload == "none":
        return
    if p.dp_size == 1:
        raise ConfigError(
            "parallel.fsdp_offload=cpu offloads FSDP's shards, and this layout has no FSDP (fsdp=1, dp_replicate=1): "
            "set parallel.fsdp > 1 or parallel.fsdp_offload=none"
        )
    if p.ep > 1:
        raise ConfigError(
            "parallel.fsdp_offload=cpu with parallel.ep > 1 is not supported: the experts are outside FSDP; "
            "set parallel.ep=1 or parallel.fsdp_offload=none"
        )


def _validate_compile(t: TrainConfig, p: ParallelConfig) -> None:
    """``train.compile`` (``train/compile.py``): inductor builds C++ kernels (all of them on CPU);
    without a compiler every rank would fail in its first compiled step. Not tested together with
    sequence parallelism (its hooks keep Python state between blocks) nor with expert parallelism
    (all-to-alls of data-dependent sizes inside a block): refused by name."""
    untested = {"parallel.sequence_parallel=true": p.sequence_parallel, f"parallel.ep={p.ep}": p.ep > 1}
    for key, on in untested.items():
        if t.compile and on:
            raise ConfigError(f"train.compile=true with {key} is not supported yet (not tested together); set one off")
    if t.compile and shutil.which(os.environ.get("CXX", "g++")) is None:
        raise ConfigError(
            "train.compile=true needs a C++ compiler on CPU (g++, or the one $CXX names) for torch.compile's "
            "inductor: install one or set train.compile=false"
        )


# schedules of torch.distributed.pipelining this version runs: one stage a rank, or several (PP_MULTI_STAGE)
PP_SCHEDULES = ("1F1B", "GPipe", *PP_MULTI_STAGE)


def _validate_pp(cfg: Config) -> None:
    """Pipeline parallelism (``parallel.pp``, docs/pipeline.md): a schedule this version runs, micro-batches
    that cut each data-parallel rank's batch evenly and fill the pipeline, and the combinations not
    supported yet refused by name (what the model decides, its block count, is ``shardlm.preflight``'s)."""
    p, t = cfg.parallel, cfg.train
    if p.pp == 1:
        return
    if p.pp_schedule.lower() not in (name.lower() for name in PP_SCHEDULES):
        raise ConfigError(
            f"parallel.pp_schedule '{p.pp_schedule}': this version runs {', '.join(PP_SCHEDULES)}; set one of them"
        )
    rows = t.per_device_train_batch_size * t.gradient_accumulation_steps
    if rows % p.pp_chunks:
        raise ConfigError(
            f"parallel.pp_microbatches={p.pp_chunks} must divide each data-parallel rank's batch of a step, "
            f"per_device_train_batch_size*gradient_accumulation_steps = {rows}; set one of them so it divides"
        )
    if p.pp_chunks < p.pp and p.pp_schedule.lower() == "1f1b":
        raise ConfigError(
            f"parallel.pp_microbatches={p.pp_chunks} is fewer than the {p.pp} stages ({p.pp_schedule} needs at "
            f"least one micro-batch per stage); set parallel.pp_microbatches to {p.pp} or more"
        )
    _validate_virtual_stages(p)
    if t.compile and p.pp_split_backward:  # measured at ZBVZeroBubble: torch refused the compiled block's backward
        raise ConfigError(
            f"train.compile with parallel.pp_schedule={p.pp_schedule}: the compiled blocks' backward donates its "
            "buffers, which needs retain_graph=False, and the schedule's input pass keeps the graph for its weight "
            "pass (torch raises); set train.compile: false or a schedule without a split backward (1F1B, GPipe, "
            "Interleaved1F1B, LoopedBFS)"
        )
    if p.ep > 1 and p.pp_split_backward:  # Interleaved1F1B and LoopedBFS with ep: one process's numbers
        raise ConfigError(
            f"parallel.ep={p.ep} with parallel.pp_schedule={p.pp_schedule}: torch's separate weight-gradient pass "
            "fails through the experts' all-to-all dispatch (measured at ZBVZeroBubble, pp=2 x fsdp=2 x ep=2: "
            "'backward through the graph a second time'); set parallel.ep: 1 or a schedule without a split "
            "backward (1F1B, GPipe, Interleaved1F1B, LoopedBFS)"
        )
    _validate_pp_cp(cfg)


def _validate_pp_cp(cfg: Config) -> None:
    """``parallel.cp`` with ``parallel.pp``: the all-gather and the Ulysses attention, activation checkpointing
    (the recompute, run in the schedule's backward, brings back its forward's shard: ``context.recompute_context``)
    and several stages a rank matched one process at pp=2 x cp=2; sequence parallelism on top (8 ranks at
    least) was never run, and is refused by name."""
    p = cfg.parallel
    if p.cp > 1 and p.sequence_parallel:
        raise ConfigError(
            f"parallel.cp={p.cp} with parallel.pp={p.pp} and parallel.sequence_parallel is not supported yet: "
            "the sequence-parallel hooks slicing a cp rank's tokens over tp inside a stage were never run under a "
            "schedule (docs/pipeline.md); set parallel.sequence_parallel: false or parallel.cp: 1"
        )


def _validate_virtual_stages(p: ParallelConfig) -> None:
    """A schedule that runs several stages a rank gets at least two, one that runs one gets one; the V-shaped
    ones exactly two; DualPipeV a micro-batch per stage or more, and interleaved micro-batches in equal
    rounds of ``pp`` (torch's rules)."""
    multi = p.pp_schedule.lower() in (name.lower() for name in PP_MULTI_STAGE)
    v = p.pp_stages_per_rank
    if multi and v < 2:
        raise ConfigError(
            f"parallel.pp_schedule={p.pp_schedule} runs several stages on each rank but parallel.pp_virtual_stages="
            f"{v}; set parallel.pp_virtual_stages to 2 or more (or null)"
        )
    if not multi and v != 1:
        raise ConfigError(
            f"parallel.pp_virtual_stages={v} needs a schedule that runs several stages a rank "
            f"({', '.join(PP_MULTI_STAGE)}), not {p.pp_schedule}; set parallel.pp_virtual_stages: 1 or such a schedule"
        )
    if p.pp_v_shaped and v != 2:
        raise ConfigError(
            f"parallel.pp_schedule={p.pp_schedule} places exactly 2 stages on each rank (a V) but "
            f"parallel.pp_virtual_stages={v}; set parallel.pp_virtual_stages: 2 (or null)"
        )
    total = p.pp * v
    if p.pp_schedule.lower() == "dualpipev" and p.pp_chunks < total:
        raise ConfigError(
            f"parallel.pp_microbatches={p.pp_chunks} is fewer than the {total} stages (DualPipeV needs at least one "
            f"micro-batch per stage); set parallel.pp_microbatches to {total} or more"
        )
    rounds = max(1, p.pp_chunks // p.pp)
    if multi and p.pp_chunks % rounds:
        raise ConfigError(
            f"parallel.pp_microbatches={p.pp_chunks}: {p.pp_schedule} runs the micro-batches in rounds of "
            f"parallel.pp={p.pp} and needs a multiple of {rounds} rounds' worth; set parallel.pp_microbatches to a "
            f"multiple of {p.pp}"
        )


def _validate_cp(cfg: Config) -> None:
    """Context parallelism splits each window into ``2 * cp`` equal chunks, rank ``r`` of ``cp``
    holding chunks ``r`` and ``2cp-1-r`` (``data/context_split.py``); with sequence parallelism those
    ``seq_len / cp`` tokens are then sliced over tp. What the model decides (its attention, its mixers)
    is checked by ``shardlm.preflight``."""
    p, seq = cfg.parallel, cfg.data.seq_len
    if p.cp_attention not in p.CP_ATTENTIONS:
        raise ConfigError(
            f"parallel.cp_attention must be one of {', '.join(p.CP_ATTENTIONS)}, got '{p.cp_attention}'; "
            "set parallel.cp_attention: all_gather (the default) or ulysses"
        )
    if p.cp > 1 and seq % (2 * p.cp):
        raise ConfigError(
            f"parallel.cp={p.cp} splits each window into 2*cp={2 * p.cp} equal chunks but data.seq_len={seq} is not "
            f"a multiple of {2 * p.cp}; set data.seq_len to a multiple of {2 * p.cp}"
        )
    if p.cp > 1 and p.sequence_parallel and (seq // p.cp) % p.tp:
        raise ConfigError(
            f"parallel.cp={p.cp} with parallel.sequence_parallel=true slices each rank's {seq // p.cp} tokens over "
            f"parallel.tp={p.tp}; set data.seq_len to a multiple of cp*tp={p.cp * p.tp} (and of 2*cp={2 * p.cp})"
        )
    for key, on in (("parallel.sequence_parallel", p.sequence_parallel), ("lora", cfg.lora is not None)):
        if p.cp > 1 and p.cp_attention == "ulysses" and on:
            raise ConfigError(
                f"parallel.cp_attention=ulysses with {key} is not supported yet (not tested together, "
                f"docs/long_sequences.md); set parallel.cp_attention: all_gather or turn {key} off"
            )
    unsupported = {
        "train.compile": cfg.train.compile,
        "parallel.fsdp_offload": p.fsdp_offload != "none",
    }
    for key, on in unsupported.items():
        if p.cp > 1 and on:
            raise ConfigError(
                f"parallel.cp={p.cp} with {key} is not supported yet (not tested together, docs/long_sequences.md); "
                f"set parallel.cp: 1 or turn {key} off"
            )


def _validate_checkpointing(t: TrainConfig) -> None:
    """Checkpoint keys (``checkpoint/manager.py``): counts, and that a resume path exists before spawning."""
    if not isinstance(t.resume, (bool, str)):
        raise ConfigError(f"train.resume must be true, false or a checkpoint path, got {t.resume!r}")
    if isinstance(t.resume, str) and not os.path.isdir(t.resume):
        raise ConfigError(f"train.resume: '{t.resume}' is not a directory; pass a checkpoint step-N or an output_dir")


def _validate_training(t: TrainConfig, e: EvalConfig) -> None:
    """Optimizer, reporting and evaluation keys (``train/optim.py``, ``train/metrics.py``, ``train/trainer.py``)."""
    if t.optim not in t.OPTIMIZERS:
        raise ConfigError(f"train.optim must be one of {', '.join(t.OPTIMIZERS)}, got '{t.optim}'")
    if t.report_to not in t.REPORT_TO:
        raise ConfigError(f"train.report_to must be one of {', '.join(t.REPORT_TO)}, got '{t.report_to}'")
    if e.path:
        if not os.path.exists(e.path):
            raise ConfigError(f"eval.path: '{e.path}' does not exist")
        if os.path.isfile(e.path) and not e.path.lower().endswith(DataConfig.EXTENSIONS):
            raise ConfigError(f"eval.path: '{e.path}' is not a {', '.join(DataConfig.EXTENSIONS)} file")
