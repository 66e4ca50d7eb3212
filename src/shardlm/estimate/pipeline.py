"""Under pipeline parallelism: each stage estimated on its own, and each rank's stages together.

Under pipeline parallelism (``pp``, ``pipeline_estimate``) each stage is estimated on its own, cut as the
ranks cut it (``estimate/stages.py``): its parameters, its blocks' activations times the micro-batches
its schedule keeps in flight (``T`` one micro-batch's tokens), the final norm and logits on the last stage.
"""

from __future__ import annotations

from torch import nn

from shardlm.estimate.rows import Estimate, model_estimate
from shardlm.estimate.stages import bubble, cut_stages, held_states
from shardlm.parallel.plan.plan import Plan


def pipeline_estimate(model: nn.Module, plan: Plan, layout: dict, memory_gib: float | None, baseline: int) -> Estimate:
    """Under ``pp``: each stage as the ranks cut it (``estimate/stages.py``), its activations those of the
    micro-batches the schedule keeps in flight there, and each rank its stages together at the moment of
    its schedule when their activations are largest (``held_states``). The estimate of the rank with the
    highest peak, with ``params_full`` the whole model's, ``stages`` (every stage's rank, blocks, parameters,
    most micro-batches in flight and peak), ``ranks`` (every rank's stages, what each holds at its peak, and
    that peak) and the schedule's bubble in ``layout``."""
    pp, schedule, chunks, per_rank = (layout[k] for k in ("pp", "pp_schedule", "pp_microbatches", "pp_virtual_stages"))
    total = pp * per_rank
    _, stages = cut_stages(model, plan, total)
    cache: dict[tuple[int, int], Estimate] = {}

    def held(stage: int, count: int) -> Estimate:  # stage ``stage`` holding ``count`` micro-batches (at least 1)
        if (stage, max(count, 1)) not in cache:
            part = stages[stage]
            config = part.model.base_model.config  # its own: its blocks' count and kinds (``keep_stage``)
            cache[stage, max(count, 1)] = model_estimate(
                part.model, config, part.plan, layout, memory_gib, baseline, max(count, 1), part.last(total)
            )
        return cache[stage, max(count, 1)]

    ranks = [_rank_peak(rank, states, held, layout, memory_gib, baseline) for rank, states in enumerate(
        held_states(schedule, pp, per_rank, chunks))]  # fmt: skip
    most = {s: max(state.get(s, 0) for r in ranks for state in r["states"]) for s in range(total)}
    peak = max(ranks, key=lambda r: r["estimate"].bytes["total"])["estimate"]
    peak.layout["bubble"] = bubble(pp, chunks, schedule, per_rank)
    owner = {s: r["rank"] for r in ranks for s in r["held"]}
    peak.stages = [_stage_row(stage, owner[stage.index], most[stage.index], held(stage.index, most[stage.index]))
                   for stage in stages]  # fmt: skip
    peak.ranks = [{k: v for k, v in r.items() if k not in ("estimate", "states")} for r in ranks]
    peak.params_full = sum(held(s, 1).params_full for s in range(total))  # the stages hold disjoint parameters
    return peak


def _stage_row(stage, rank: int, count: int, est: Estimate) -> dict:
    return {
        "stage": stage.index,
        "rank": rank,
        "blocks": [stage.blocks.start, stage.blocks.stop],
        "params": est.params_full,
        "params_local": est.params_local,
        "in_flight": count,
        "activations": est.bytes["activations"],
        "total": est.bytes["total"],
        "state": est.state_bytes,  # parameters, gradients, optimizer state: on the host under fsdp_offload
        "host": est.host_bytes,
    }


_HELD_ROWS = ("activations", "logits")  # a stage's rows that scale with the micro-batches it holds


def _rank_peak(rank: int, states: list[dict[int, int]], held, layout: dict, memory_gib, baseline) -> dict:
    """Rank ``rank``'s estimate: its stages' model state and buffers summed, and the activations and logits
    its stages hold together at the step of its schedule where those are largest (``states``: what each
    stage holds after each action; ``held(stage, count)``: a stage's estimate holding ``count``)."""

    def live(state: dict[int, int]) -> int:
        return sum(held(s, n).bytes[k] for s, n in state.items() if n for k in _HELD_ROWS)

    top = max(states, key=live)
    parts = [held(s, 1) for s in top]
    rows = {k: sum(p.bytes[k] for p in parts) for k in parts[0].bytes if k not in (*_HELD_ROWS, "total")}
    rows |= {k: sum(held(s, n).bytes[k] for s, n in top.items() if n) for k in _HELD_ROWS}
    est = Estimate(dict(layout), sum(p.params_full for p in parts), sum(p.params_local for p in parts),
                   sum(p.trainable_local for p in parts), rows, memory_gib, baseline)  # fmt: skip
    rows["total"] = max(est.step_bytes, est.optimizer_step_bytes)
    return {"rank": rank, "held": dict(top), "activations": rows["activations"], "logits": rows["logits"],
            "total": rows["total"], "estimate": est, "states": states}  # fmt: skip
