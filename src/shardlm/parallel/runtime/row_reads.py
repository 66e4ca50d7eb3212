"""Rows of the vocabulary-parallel input embedding read by index outside its forward (``Plan.row_reads``).

Gemma 4's multimodal forward reads ``self.language_model.embed_tokens.weight[pad_token_id]`` (the row
it puts in place of image and audio tokens before the per-layer embeddings are looked up). The weight
is ``Shard(0)`` over TP (``embedding.py``): a rank may not hold that row, and a DTensor meeting the
model's plain activations fails. While the reading module runs, every registration of the weight (the
embedding, a tied LM head) holds a ``RowReader`` instead: indexing it gives the whole row, looked up
as the embedding looks up ids (the rank holding the row reads it, the others give zeros, summed over
TP: one all-reduce of one row; backward, the row's gradient reaches the rank holding it, its
``Shard(0)`` piece, as the embedding's own gradients do). The embedding's own forward, run inside the
reader (Gemma 4 embeds the ids there), takes its local piece from ``RowReader.to_local``, as it does
from its DTensor. The trace recorded only reads of whole rows by an int index (``tracker._row_index``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardlm.distributed.shards import LocalParams, local_index, local_view
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.runtime.regions import reduce_from_region


class RowReader:
    """The embedding's weight as a reading module sees it: whole rows by index, its local piece."""

    def __init__(self, weight: torch.Tensor, rows: dict[int, int], mesh: DeviceMesh):
        self.weight, self.rows, self.mesh = weight, rows, mesh

    def to_local(self) -> torch.Tensor:
        return local_view(self.weight)

    def __getattr__(self, name: str):  # dtype, device, shape: the weight's
        return getattr(self.weight, name)

    def __getitem__(self, index) -> torch.Tensor:
        row, cols = index if isinstance(index, tuple) else (index, slice(None))
        local = self.weight.to_local()
        held = self.rows.get(row % self.weight.shape[0])
        part = local[held] if held is not None else local.new_zeros(local.shape[1:])
        return reduce_from_region(part, self.mesh)[cols]


def serve_row_reads(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Hooks on each module of ``plan.row_reads``: the embedding weight's registrations hold a
    ``RowReader`` while it runs (module docstring)."""
    for user, emb in plan.row_reads.items():
        weight = model.get_submodule(emb).weight
        places = [
            (m, n) for m in model.modules() for n, p in m._parameters.items() if p is weight
        ]  # the embedding and a tied LM head: FSDP2 registers its unsharded parameter in each
        rows = {int(r): i for i, r in enumerate(local_index(weight, 0))}
        _hook(model.get_submodule(user), model.get_submodule(emb), places, rows, mesh)


def _hook(user: nn.Module, emb: nn.Module, places: list, rows: dict[int, int], mesh: DeviceMesh) -> None:
    params = LocalParams()

    def enter(mod, args):
        reader = RowReader(emb._parameters["weight"], rows, mesh)
        for module, name in places:
            params.swap(module, name, reader)

    user.register_forward_pre_hook(enter)
    user.register_forward_hook(lambda mod, args, out: params.restore())
