"""Which decoder blocks each pipeline stage holds (``parallel.pp``): contiguous runs, balanced by
parameter count with the embedding weighed in on the first stage and the final norm and head on the
last (as torchtitan balances its stages), so no stage carries the vocabulary matrices on top of an
equal share of blocks.

Pure arithmetic over counts: the model's modules are read by ``infer/stages.py`` and cut by
``runtime/pipeline.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.errors import ConfigError


@dataclass(frozen=True)
class StageSplit:
    """``blocks[s]``: the indices of the decoder blocks stage ``s`` runs (contiguous, in order);
    ``params[s]``: its parameter count, embedding and head included."""

    blocks: tuple[range, ...]
    params: tuple[int, ...]

    @property
    def stages(self) -> int:
        return len(self.blocks)


def balance(block_params: list[int], first_extra: int, last_extra: int, stages: int) -> StageSplit:
    """The contiguous split of ``block_params`` into ``stages`` non-empty runs whose largest stage
    (``first_extra`` added to the first, ``last_extra`` to the last) is smallest; among equal
    maxima the earliest cut points win, so the answer is the same on every rank."""
    n = len(block_params)
    if stages > n:
        raise ConfigError(
            f"parallel.pp: {stages} pipeline stages (pp x the stages a rank holds) but the model has {n} decoder "
            f"blocks; set parallel.pp (or parallel.pp_virtual_stages) so that there are at most {n}"
        )
    prefix = [0]
    for count in block_params:
        prefix.append(prefix[-1] + count)

    def weight(stage: int, lo: int, hi: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)
        return prefix[hi] - prefix[lo] + extra

    # best[s][i]: the smallest largest weight of stages s.. over blocks i.., with the cut it takes
    inf = float("inf")
    best = [[(inf, n)] * (n + 1) for _ in range(stages + 1)]
    best[stages][n] = (0, n)
    for s in range(stages - 1, -1, -1):
        for i in range(n - (stages - s), -1, -1):
            for j in range(i + 1, n - (stages - s - 1) + 1):
                worst = max(weight(s, i, j), best[s + 1][j][0])
                if worst < best[s][i][0]:
                    best[s][i] = (worst, j)
    cuts, i = [], 0
    for s in range(stages):
        j = best[s][i][1]
        cuts.append(range(i, j))
        i = j
    return StageSplit(tuple(cuts), tuple(weight(s, r.start, r.stop) for s, r in enumerate(cuts)))


@dataclass(frozen=True)
class StageLayout:
    """The stages of a model, its modules named by FQN: ``split`` (the blocks of each), ``blocks`` (the
    ModuleList holding them), ``embedding`` (first stage only), ``after`` (the base model's children
    that run after the last block: the final norm, last stage only) and ``head`` (the output
    embedding, last stage only). ``tied``: the head's weight is the input embedding's
    (``tie_word_embeddings``): the last stage holds the embedding too, and the two stages keep their
    copies equal by summing their gradients (``train/pipeline_step.py``). ``before``: the base model's
    children with parameters that run before the first block (GPT-2's learned position embedding), the
    first stage's; ``restarts``: the forward changes the embeddings before the first block (such a
    module, Gemma's scale by sqrt(hidden), a dropout), so a later stage hands the hidden states it
    receives to its first block itself. ``sites``: where the model draws dropout, the count of dropout
    calls one process's forward has made on entering each block (empty: it draws none), from which a
    later stage's masks resume (``runtime/dropout.py`` numbers them in call order)."""

    split: StageSplit
    blocks: str
    embedding: str
    after: tuple[str, ...]
    head: str
    tied: bool = False
    before: tuple[str, ...] = ()
    restarts: bool = False
    sites: tuple[int, ...] = ()


def rank_stages(rank: int, pp: int, per_rank: int, v_shaped: bool) -> list[int]:
    """The stage indices rank ``rank`` of ``pp`` holds, ``per_rank`` of them, in order: in loops (``rank``,
    ``rank + pp``, ...) or, for the V-shaped schedules, ``rank`` and ``2 pp - 1 - rank`` (torch's
    ``generate_stage_to_rank_mapping``, whose placement the schedules check)."""
    if v_shaped:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


def stage_owner(stage: int, pp: int, per_rank: int, v_shaped: bool) -> int:
    """The pipeline rank that holds stage ``stage`` (the inverse of ``rank_stages``)."""
    return next(r for r in range(pp) if stage in rank_stages(r, pp, per_rank, v_shaped))
