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

Under the schedules with several stages a rank (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
``ZBVZeroBubble``, ``DualPipeV``) the count is read from the schedule's own action list, the
``pipeline_order`` torch computes for every rank (built here with stand-in stages, ``schedule_actions``):
walking a rank's actions in order, a forward ``F`` of stage ``s`` adds a micro-batch to what ``s`` holds,
its full backward ``B`` releases it, and under a split backward its input pass ``I`` does not (torch's
``stage_backward_input`` keeps the graph, ``retain_graph=True``, for the weight pass) while its weight pass
``W`` does. The rank's peak is the moment its stages' activations together are largest
(``held_states``). torch's ``pipeline_order`` of ``1F1B`` is for display only (its later ranks' micro-batch
numbers are off by one, torch 2.13) and the single-stage schedules do not run from it: they keep the
counts above.

Bubble (the fraction of a step a rank idles, a backward about twice a forward): ``(p - 1) / (m + p - 1)``
for both; ``(p - 1) / (v m + p - 1)`` for the interleaved ones and ``LoopedBFS`` with ``v`` stages a rank;
about 0 for the zero-bubble ones (the weight passes fill the gaps).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from shardlm.config.schema import PP_MULTI_STAGE, PP_SPLIT_BACKWARD, PP_V_SHAPED
from shardlm.errors import ConfigError
from shardlm.parallel.infer.stages import stage_layout
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.stages import StageLayout, rank_stages
from shardlm.parallel.runtime.pipeline import keep_stage, stage_plan

SCHEDULES = ("1F1B", "GPipe")  # one stage a rank: the counts of the module docstring (``plan --pp`` shows both)
ALL_SCHEDULES = (*SCHEDULES, *PP_MULTI_STAGE)  # what ``estimate --pp-schedule`` takes, as ``parallel.pp_schedule``


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
    """``schedule`` as ``ALL_SCHEDULES`` spells it (case aside), or a ``ConfigError`` naming the flag."""
    for name in ALL_SCHEDULES:
        if name.lower() == schedule.lower():
            return name
    raise ConfigError(f"--pp-schedule '{schedule}': the estimate models {', '.join(ALL_SCHEDULES)}; pick one of them")


def stages_per_rank(schedule: str, virtual: int | None) -> int:
    """Stages each rank holds under ``schedule`` (``ParallelConfig.pp_stages_per_rank``'s rule): ``virtual``,
    by default 2 under a schedule with several a rank and 1 otherwise; a count the schedule cannot run refused."""
    multi = schedule in PP_MULTI_STAGE
    per_rank = virtual if virtual is not None else (2 if multi else 1)
    if (multi and per_rank < 2) or (not multi and per_rank != 1) or (schedule in PP_V_SHAPED and per_rank != 2):
        want = "exactly 2" if schedule in PP_V_SHAPED else "2 or more" if multi else "1"
        raise ConfigError(f"--pp-virtual-stages {per_rank}: {schedule} runs {want} stages a rank; set it so")
    return per_rank


class _StageStandIn:
    """What torch's multi-stage schedules read of a stage to compute their ``pipeline_order``: no module runs."""

    def __init__(self, index: int, stages: int, pp: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, pp, 0
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = nn.Module()


def schedule_actions(schedule: str, pp: int, per_rank: int, chunks: int) -> dict[int, list]:
    """torch's own compute actions of a multi-stage ``schedule`` (its ``pipeline_order``, every rank's, in
    order; an overlapped forward and backward as its two actions, forward first); torch's refusal of the
    micro-batch count as one line."""
    stages = pp * per_rank
    mine = rank_stages(0, pp, per_rank, schedule in PP_V_SHAPED)
    try:
        built = get_schedule_class(schedule)([_StageStandIn(i, stages, pp) for i in mine], chunks, scale_grads=False)
    except (ValueError, RuntimeError) as exc:
        why = " ".join(str(exc).split())
        raise ConfigError(f"--pp-schedule {schedule} with --pp {pp} and --pp-microbatches {chunks}: {why}") from None
    return {rank: list(_flat(actions)) for rank, actions in built.pipeline_order.items()}


def _flat(actions):
    for action in actions:
        if action is not None and action.sub_actions:
            yield from _flat(action.sub_actions)
        elif action is not None:
            yield action


def held_states(schedule: str, pp: int, per_rank: int, chunks: int) -> list[list[dict[int, int]]]:
    """Per rank, after each of its actions: how many micro-batches' activations each of its stages holds
    (module docstring); under a single-stage schedule one state, its count."""
    if issubclass(get_schedule_class(schedule), PipelineScheduleSingle):
        return [[{rank: microbatches_in_flight(schedule, rank, pp, chunks)}] for rank in range(pp)]
    out = []
    for rank, actions in sorted(schedule_actions(schedule, pp, per_rank, chunks).items()):
        held = dict.fromkeys(rank_stages(rank, pp, per_rank, schedule in PP_V_SHAPED), 0)
        states = []
        for action in actions:
            kind = action.computation_type.value
            if kind in ("F", "B", "W"):  # an input pass ``I`` keeps the graph for the weight pass
                held[action.stage_index] += 1 if kind == "F" else -1
                states.append(dict(held))
        out.append(states)
    return out


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


def bubble(stages: int, microbatches: int, schedule: str = "1F1B", per_rank: int = 1) -> float:
    """The fraction of a step each rank idles (module docstring); ``stages``: the ranks of the pipeline."""
    if schedule in PP_SPLIT_BACKWARD:
        return 0.0
    return (stages - 1) / (per_rank * microbatches + stages - 1)


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
