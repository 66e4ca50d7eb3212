"""The range of every numeric config key, as one table (``RULES``): the single source of truth that
``load.validate`` checks a config against and ``shardlm estimate`` checks its flags against.

Why a table: a value out of range (a negative warmup, a NaN learning rate, a momentum of 1) either
fails deep inside a rank with a traceback or, worse, trains on silently with a changed schedule;
one rule per key, checked before anything is spawned, answers each with one line naming the key.
Every float must also be finite (NaN and inf are refused for every key). What only the model can
bound (``data.seq_len`` against its positions) is checked in ``shardlm.preflight``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlm.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """``low <= value`` (``low < value`` when ``low_open``) and ``value < high`` when ``high`` is set;
    ``note`` says what a boundary value means, in the error line."""

    low: float
    low_open: bool = False
    high: float | None = None
    note: str = ""
    says: str = ""  # the whole range in words, where that reads better than the bounds

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value < self.high)

    def describe(self) -> str:
        if self.says:
            return self.says
        if self.high is not None:
            return f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)})"
        return f"{'>' if self.low_open else '>='} {_num(self.low)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Rule(0, low_open=True)
AT_LEAST_1 = Rule(1)
AT_LEAST_0 = Rule(0)
FRACTION = Rule(0, high=1)  # a probability or an Adam beta: 1 is never meant
MAX_WORLD = 1 << 17  # ranks: more than any launcher here starts (bounds a mistyped --fsdp 1000000)

RULES: dict[str, Rule] = {
    "data.seq_len": Rule(2, note="at least one input and its next-token label"),
    "parallel.tp": AT_LEAST_1,
    "parallel.fsdp": AT_LEAST_1,
    "parallel.dp_replicate": AT_LEAST_1,
    "parallel.ep": AT_LEAST_1,
    "parallel.pp": AT_LEAST_1,
    "parallel.pp_microbatches": AT_LEAST_1,
    "parallel.cp": AT_LEAST_1,
    "train.max_steps": AT_LEAST_1,
    "train.per_device_train_batch_size": AT_LEAST_1,
    "train.gradient_accumulation_steps": AT_LEAST_1,
    "train.logging_steps": AT_LEAST_1,
    "train.learning_rate": POSITIVE,
    "train.warmup_steps": Rule(0, note="0: no warmup"),
    "train.weight_decay": AT_LEAST_0,
    "train.adam_beta1": FRACTION,
    "train.adam_beta2": FRACTION,
    "train.adam_epsilon": POSITIVE,
    "train.sgd_momentum": AT_LEAST_0,
    "train.max_grad_norm": Rule(0, note="0 turns clipping off"),
    "train.seed": AT_LEAST_0,
    "train.save_steps": Rule(0, note="0 turns checkpoints off"),
    "train.save_total_limit": AT_LEAST_1,
    "train.max_bad_steps": Rule(1, note="non-finite steps in a row before stopping"),
    "train.timeout_s": Rule(0, low_open=True, says="a positive number of seconds (default 600)"),
    "eval.steps": Rule(0, note="0: evaluate only at the end"),
    "eval.max_batches": AT_LEAST_1,
    "lora.r": AT_LEAST_1,
    "lora.alpha": POSITIVE,
    "lora.dropout": FRACTION,
}

NULLABLE = {"parallel.pp_microbatches", "train.save_total_limit", "eval.max_batches", "lora.r", "lora.alpha"}


def check_value(key: str, value: float | None, name: str | None = None) -> None:
    """Refuse ``value`` outside ``RULES[key]``; ``name``: how the user wrote it (a CLI flag), default the key."""
    if value is None and key in NULLABLE:
        return
    rule = RULES[key]
    if value is None or not rule.holds(value):
        null = " or null" if key in NULLABLE else ""
        note = f" ({rule.note})" if rule.note else ""
        finite = "a finite number " if value is not None and not math.isfinite(value) and not rule.says else ""
        raise ConfigError(f"{name or key} must be {finite}{rule.describe()}{null}{note}, got {value}")


def check_ranges(cfg) -> None:
    """Every numeric key of ``cfg`` (a ``Config``) against its rule, in table order; then the world size."""
    for key in RULES:
        section, _, leaf = key.partition(".")
        node = getattr(cfg, section)
        if node is not None:  # an absent optional section (``lora``) has nothing to check
            check_value(key, getattr(node, leaf))
    p = cfg.parallel
    names = "parallel pp*dp_replicate*fsdp*cp*tp" if p.cp > 1 else "parallel pp*dp_replicate*fsdp*tp"
    check_world(p.tp * p.cp, p.fsdp, p.dp_replicate, names, pp=p.pp)


def check_world(
    tp: int, fsdp: int, dp_replicate: int, names: str = "parallel dp_replicate*fsdp*tp", pp: int = 1
) -> None:
    """A world of more than ``MAX_WORLD`` ranks is a typo, not a layout."""
    world = pp * tp * fsdp * dp_replicate
    if world > MAX_WORLD:
        raise ConfigError(f"{names} = {world} ranks; at most {MAX_WORLD} are supported: check the numbers")
