"""Pipeline stages in the estimate (``shardlm estimate --pp`` / ``shardlm plan --pp``): the stages the
runtime would cut, how many micro-batches' activations each holds at once under a schedule, and the
schedule's bubble.

Why the stages are cut here exactly as the ranks cut them: the estimate's per-stage parameters must be
what the ranks hold, so the same ``infer/stages.py: stage_layout`` (balanced by ``plan/stages.py``) and
``runtime/pipeline.py: keep_stage`` make them, on meta copies of the model (one source of truth).

Micro-batches in flight on stage ``s`` of ``p`` with ``m`` micro-batches a step (torch's schedules,
``torch/distributed/pipelining/schedules.py``):

* ``GPipe``: every forward before any backward, so each stage holds all ``m``.
* ``1F1B``: stage ``s`` runs ``p - 1 - s`` warm-up forwards, then one forward and one backward in
  turn: ``min(p - s, m)`` at once, so the first stage holds ``p`` and the last one.

Bubble (the fraction of a step a rank idles, a backward about twice a forward): ``(p - 1) / (m + p - 1)``
for both.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from shardlm.errors import ConfigError
from shardlm.parallel.infer.stages import stage_layout
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.stages import StageLayout
from shardlm.parallel.runtime.pipeline import keep_stage, stage_plan

SCHEDULES = ("1F1B", "GPipe")  # the schedules whose activations in flight the estimate models


@dataclass
class Stage:
    """One stage of the model: its index, the decoder blocks it runs, the meta module holding only
    them (``keep_stage``), and the plan narrowed to it (``stage_plan``)."""

    index: int
    blocks: range
    model: nn.Module
    plan: Plan

    @property
    def first(self) -> bool:
        return self.index == 0

    def last(self, stages: int) -> bool:
        return self.index == stages - 1


def schedule_name(schedule: str) -> str:
    """``schedule`` as ``SCHEDULES`` spells it (case aside), or a ``ConfigError`` naming the flag."""
    for name in SCHEDULES:
        if name.lower() == schedule.lower():
            return name
    raise ConfigError(f"--pp-schedule '{schedule}': the estimate models {' and '.join(SCHEDULES)}; pick one of them")


def check_microbatches(pp: int, schedule: str, microbatches: int) -> None:
    """``--pp-microbatches`` as ``parallel.pp_microbatches`` is checked (``config/load.py``)."""
    if microbatches < 1:
        raise ConfigError(f"--pp-microbatches must be >= 1, got {microbatches}")
    if schedule == "1F1B" and microbatches < pp:
        raise ConfigError(
            f"--pp-microbatches {microbatches} is fewer than the {pp} stages (1F1B needs at least one micro-batch "
            f"per stage); set it to {pp} or more"
        )


def microbatches_in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once (module docstring)."""
    return microbatches if schedule == "GPipe" else min(stages - stage, microbatches)


def bubble(stages: int, microbatches: int) -> float:
    """The fraction of a step each rank idles under 1F1B or GPipe."""
    return (stages - 1) / (microbatches + stages - 1)


def cut_stages(model: nn.Module, plan: Plan, pp: int) -> tuple[StageLayout, list[Stage]]:
    """The layout of ``model`` (a meta model) in ``pp`` stages and each stage as a meta copy cut by
    ``keep_stage``, with ``plan`` (the whole model's) narrowed to it."""
    layout = stage_layout(model, pp)
    stages = []
    for index, blocks in enumerate(layout.split.blocks):
        part = copy.deepcopy(model)
        keep_stage(part, layout, index)
        stages.append(Stage(index, blocks, part, stage_plan(plan, part)))
    return layout, stages
