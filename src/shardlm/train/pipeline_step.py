"""The forward and backward of one optimizer step under pipeline parallelism (``parallel.pp``).

The same training as without stages: each data-parallel rank's micro-batches of the step (the
``gradient_accumulation_steps`` batches of ``data/dataset.py``, in order) are joined into its batch
of the step, which ``torch.distributed.pipelining``'s schedule (``parallel.pp_schedule``) cuts into
``parallel.pp_microbatches`` micro-batches and runs through the stages. The loss each micro-batch
backpropagates is its token-loss sum divided by the labelled-token count of the whole global batch
(``train/loss.py``), exactly what the micro-steps without stages backpropagate; the schedule's own
averaging over micro-batches is off (``scale_grads=False``). The last stage's loss sum is broadcast
to the other stages, so every rank logs the same loss; the gradient norm is summed over the stages
by ``distributed/clip.py``. Evaluation sends each batch through the stages in turn (``logits_of``).

Tied embeddings (``StageLayout.tied``): the first stage holds the input embedding and the last the head
that shares its weight, each a copy. As Megatron does, the two copies' gradients (each already summed
over the stage's data-parallel ranks by FSDP) are summed between the first and the last stage of the
same data-parallel place, before clipping, so both copies get the one-process gradient and stay equal
through identical optimizer steps; the norm counts the weight once (on the first stage).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor

from shardlm.config import ParallelConfig
from shardlm.data.context_split import chunk_index, split_batch, window_positions
from shardlm.data.dataset import Batch
from shardlm.distributed.mesh import Mesh
from shardlm.distributed.shards import as_local
from shardlm.parallel.plan.stages import stage_owner
from shardlm.parallel.runtime.dropout import DropoutKey
from shardlm.parallel.runtime.pipeline import PipelineStageModule, RankStages
from shardlm.train.loss import token_loss_sum

_DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # what hidden states between stages can be


class PipelineStep:
    """Runs this rank's stages of every step's schedule (``forward_backward``); ``module``: the stage, or
    the ``RankStages`` of a schedule with several stages a rank; ``autocast``: the trainer's choice of
    bf16 autocast (``train.bf16`` where FSDP does not cast)."""

    def __init__(
        self, module: PipelineStageModule | RankStages, mesh: Mesh, parallel: ParallelConfig, autocast: bool
    ) -> None:
        self.parts = list(module) if isinstance(module, RankStages) else [module]
        self.group = mesh.pp.get_group()
        per_rank, v_shaped = parallel.pp_stages_per_rank, parallel.pp_v_shaped
        total = parallel.pp * per_rank
        self.stages = []
        # under parallel.cp each stage's ranks split every window as without stages (``_context_split``)
        self.context = None
        if parallel.cp > 1:
            self.context = (parallel.cp, mesh.cp.get_local_rank(), mesh.cp.get_group(), parallel.cp_attention)
        for part in self.parts:
            part.autocast = mesh.device.type if autocast else None
            part.context = self.context
            self.stages.append(PipelineStage(part, part.index, total, mesh.device, group=self.group))
        self.owner = [stage_owner(i, parallel.pp, per_rank, v_shaped) for i in range(total)]  # pp rank of stage i
        schedule = get_schedule_class(parallel.pp_schedule)
        stages = self.stages if per_rank > 1 else self.stages[0]
        self.schedule = schedule(stages, n_microbatches=parallel.pp_chunks, loss_fn=self._loss, scale_grads=False)
        self.last = dist.get_global_rank(self.group, self.owner[-1])
        self.denom = 1.0
        self.shared_group = _first_and_last(mesh) if self.parts[0].tied else None

    def _sum_shared(self) -> None:
        """Sum the gradients of the tied weight's two copies (first and last stage), in place; a frozen
        weight (a LoRA run) has none on either stage."""
        for part in self.parts:
            for name in part.shared:
                grad = part.model.get_parameter(name).grad
                if grad is None:
                    continue
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.shared_group)

    def counted_elsewhere(self) -> list[torch.Tensor]:
        """This rank's parameters whose gradient another stage holds too and counts in the norm: the
        tied weight's copy on the last stage (the first stage's copy is counted)."""
        return [part.model.get_parameter(name) for part in self.parts if part.last for name in part.shared]

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss on the last stage: its token-loss sum over the global count (the
        schedule also calls it once on its first step to learn the shapes of the backward)."""
        return token_loss_sum(logits, labels) / self.denom

    def forward_backward(self, batches: list[Batch], denom: float, dropout: DropoutKey | None = None) -> torch.Tensor:
        """Collective over the stages: run the schedule over this rank's ``batches`` of the step, the
        gradients of ``sum of token losses / denom`` accumulated; this rank's token-loss sum (the same
        on every stage). ``dropout``: the step's dropout key, ``positions`` those of every sample of
        ``batches`` in the global batch, cut into micro-batches with them."""
        kwargs = {}
        if self.context is not None:
            batches, kwargs["window"], dropout = self._context_split(batches, dropout)
        ids = torch.cat([b.input_ids for b in batches])
        labels = torch.cat([b.labels for b in batches])
        if batches[0].position_ids is not None:
            kwargs["position_ids"] = torch.cat([b.position_ids for b in batches])
        if dropout is not None and self.parts[0].draws_dropout:
            kwargs["samples"] = dropout.positions.to(ids.device)
        for part in self.parts:
            part.dropout = dropout if "samples" in kwargs else None
        self.denom, losses = denom, []
        args = (ids,) if self.parts[0].first else ()
        try:
            self.schedule.step(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
        finally:
            for part in self.parts:
                part.dropout = None
        if self.shared_group is not None:
            self._sum_shared()
        # the micro-batches' losses, as the schedule reports them: the last stage's token-loss sum
        losses = [as_local(loss).detach() for loss in losses]
        total = torch.stack(losses).sum() * denom if losses else torch.zeros((), device=ids.device)
        dist.broadcast(total, src=self.last, group=self.group)
        return total

    def _context_split(
        self, batches: list[Batch], dropout: DropoutKey | None
    ) -> tuple[list[Batch], torch.Tensor, DropoutKey | None]:
        """Under context parallelism: this rank's tokens of each of ``batches`` (``data/context_split.py``: two
        chunks of every window, head and tail, with their position ids), the position ids of the whole
        windows, which the schedule cuts into micro-batches with the tokens and every stage builds its
        attention's shard from (``PipelineStageModule.forward``), and the dropout key placing this rank's
        tokens in the window (as ``Trainer.dropout_mode`` does without stages)."""
        cp, rank = self.context[0], self.context[1]
        windows = [window_positions(b) for b in batches]
        seq_len = windows[0].shape[1]
        index = chunk_index(seq_len, cp, rank, windows[0].device)
        if dropout is not None:
            dropout = replace(dropout, sequence=(index, seq_len))
        return [split_batch(b, index) for b in batches], torch.cat(windows), dropout

    @torch.no_grad()
    def logits_of(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Collective over the stages, for evaluation (batches of any size, so no schedule): the batch
        through every stage in turn; the logits on the rank of the last stage, None on the others."""
        me, out = self.group.rank(), None
        for part in self.parts:
            i = part.index
            if part.first:
                x = input_ids
            elif self.owner[i - 1] == me:  # the previous stage is this rank's too
                x = out
            else:
                x = self._recv(dist.get_global_rank(self.group, self.owner[i - 1]))
            out = part(x, position_ids)
            if part.last:
                return out
            if self.owner[i + 1] != me:
                header = torch.tensor([*out.shape, _DTYPES.index(out.dtype)], device=out.device)
                dist.send(header, dist.get_global_rank(self.group, self.owner[i + 1]), group=self.group)
                dist.send(out.contiguous(), dist.get_global_rank(self.group, self.owner[i + 1]), group=self.group)
        return None

    def _recv(self, src: int) -> torch.Tensor:
        """The previous stage's hidden states, ``[batch, seq, hidden]``, shape and dtype sent ahead."""
        device = self.stages[0].device
        header = torch.empty(4, dtype=torch.long, device=device)
        dist.recv(header, src, group=self.group)
        *shape, dtype = header.tolist()
        hidden = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
        dist.recv(hidden, src, group=self.group)
        return hidden


def _first_and_last(mesh: Mesh) -> dist.ProcessGroup | None:
    """Collective over the world: one group per data-parallel place of its first and last stage (the
    ranks holding a tied weight's two copies); this rank's, None on a middle stage."""
    ranks = mesh.world.mesh.reshape(mesh.parallel.pp, -1)
    pairs = [[int(a), int(b)] for a, b in zip(ranks[0], ranks[-1])]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group
