"""Plan words -> torch ``ParallelStyle`` objects: ``make_style`` for one word of ``plan.styles.Style``,
``plan_styles`` for every module of a plan.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from shardlm.parallel.plan.channels import local_views
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import ExpertParam, Style
from shardlm.parallel.runtime.channels import PerChannel
from shardlm.parallel.runtime.embedding import VocabParallelEmbedding
from shardlm.parallel.runtime.experts import ExpertsParallel
from shardlm.parallel.runtime.linear import (
    Colwise,
    LatentColwise,
    PackedColwiseParallel,
    Rowwise,
    SlicedColwise,
)
from shardlm.parallel.runtime.replicate import LocalReplicate, ReplicateParallel, ShardedRMSNorm


def make_style(
    style: str,
    parts: list[int] | None = None,
    rows: list | None = None,
    experts: dict[str, ExpertParam] | None = None,
    views: dict | None = None,
    latent_input: bool = False,
    summed: bool = False,
    sequence_parallel: bool = False,
    narrowed: bool = False,
    stored_rows: list | None = None,
) -> ParallelStyle:
    """The torch style for one word of the plan vocabulary (``styles.Style``; what each shards:
    ``styles.PLACEMENTS``); ``rows``: the plan's ``sliced`` entry (replicated parameters, per-rank
    output rows); ``experts``: the plan's ``experts`` entry of an experts or ``per_channel``
    module; ``views``: a ``per_channel`` module's ``channels.local_views``; ``latent_input``: a
    ``colwise`` layer reads a low-rank latent kept whole (``Plan.latent_readers``); ``summed``: a
    ``rowwise`` layer's output gradient is summed over TP (``Plan.summed``); ``sequence_parallel``: a
    ``rowwise`` layer's output (an ``embedding``'s partial sums) is reduce-scattered over the sequence
    (``runtime/sequence.py``); ``narrowed``: a ``rowwise`` layer's output narrowed to this rank's heads'
    columns (``Plan.narrowed``); ``stored_rows``: a ``colwise`` layer's per-rank rows, stored by them
    (``Plan.stored_rows``)."""
    if rows is not None:
        return SlicedColwise(rows)
    match Style(style):
        case Style.COLWISE:
            return LatentColwise() if latent_input else Colwise(rows=stored_rows)
        case Style.ROWWISE:
            if sequence_parallel:
                return Rowwise("scattered")
            if narrowed:  # one value per head, each rank its heads' columns (``Plan.narrowed``)
                return Rowwise("narrowed")
            return Rowwise("summed") if summed else Rowwise()
        case Style.PACKED_COLWISE:
            return PackedColwiseParallel(parts, latent_input)
        case Style.EMBEDDING:
            # vocab rows sharded; each rank looks up its rows on local tensors, the partial sums all-reduced
            # (reduce-scattered where the stream enters its sequence slices there: ``plan.sequence.stream_ends``)
            return VocabParallelEmbedding(scattered=sequence_parallel)
        case Style.LM_HEAD:
            # logits stay sharded over the vocabulary: the loss is computed on them (runtime/cross_entropy.py)
            return Colwise(sharded_output=True)
        case Style.REPLICATE | Style.REPLICATE_GRAD_ALLREDUCE:
            return ReplicateParallel()
        case Style.REPLICATE_LOCAL:
            return LocalReplicate()
        case Style.REPLICATE_OWN:
            return LocalReplicate(own_only=True)
        case Style.SHARDED_NORM:
            return ShardedRMSNorm()
        case Style.EXPERTS:
            return ExpertsParallel(experts or {})
        case Style.PER_CHANNEL:
            return PerChannel(experts or {}, views or {})


def plan_styles(plan: Plan, scattered: set[str] | frozenset = frozenset()) -> dict[str, ParallelStyle]:
    """The torch style of every module of ``plan``; ``scattered``: the row-parallel layers whose output is
    reduce-scattered over the sequence (``plan.sequence.scattered_rows``), and the embedding whose partial
    sums are (``plan.sequence.stream_ends``)."""
    return {
        fqn: make_style(
            s,
            plan.parts.get(fqn),
            plan.sliced.get(fqn),
            plan.experts.get(fqn),
            local_views(plan, fqn),
            fqn in plan.latent_readers,
            fqn in plan.summed,
            fqn in scattered,
            fqn in plan.narrowed,
            plan.stored_rows.get(fqn),
        )
        for fqn, s in plan.styles.items()
    }
