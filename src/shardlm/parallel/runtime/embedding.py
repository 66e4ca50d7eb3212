"""The vocabulary-parallel input embedding (the plan's ``embedding``), as Megatron-LM's
``VocabParallelEmbedding`` computes it: on local tensors.

The weight is ``Shard(0)`` over TP: each rank holds a run of vocabulary rows (torch's chunks: with a
vocabulary that does not divide, the last rank holds fewer; ``shards.local_index`` says which, the
rule the weights are filled by). Each rank looks up the ids that fall in its rows (the others read
local row 0), zeroes the rows of the other ids, and the ranks' outputs are summed over TP
(``regions.reduce_from_region``: one all-reduce, as torch's ``RowwiseParallel`` issues; under sequence
parallelism, where the stream may enter its slices here, a reduce-scatter: ``plan.sequence.stream_ends``). Backward:
the embedding's gradient on each rank is its ``Shard(0)`` piece, from a lookup backward over its own
rows only; through DTensor dispatch (torch's style) it was the whole ``[vocab, hidden]`` on every rank
(a ``Replicate`` gradient) from a full-vocabulary backward.

The module's own forward runs (a scaled embedding multiplies by its scale: linear, so zeroing and
summing after it is the same), on the local weight swapped in by the style's hooks (``LocalParams``,
as ``replicate.LocalReplicate`` does) and a ``padding_idx`` moved to local rows. A tied LM head holds the
same ``Shard(0)`` parameter (``build.apply_tp``): both gradients are ``Shard(0)`` pieces and add up.
``max_norm`` / ``scale_grad_by_freq`` / ``sparse`` embeddings act on the rows the ids meet, which the
masked ids would distort: they keep torch's DTensor style. A normed embedding (Inkling's
``embed_norm(lookup)``, ``hf.lookup_norm``) is zeroed and summed at its norm's input instead: the
norm is not linear, so it runs on the whole rows (its weight replicated, the same on every rank).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from shardlm.distributed.shards import LocalParams, local_index, local_view
from shardlm.parallel.model.hf import looks_up_rows, lookup_norm
from shardlm.parallel.runtime.linear import shard_params
from shardlm.parallel.runtime.regions import reduce_from_region, reduce_scatter_in_place


class VocabParallelEmbedding(ParallelStyle):
    """``nn.Embedding`` sharded by vocabulary rows, looked up on local tensors (module docstring);
    ``scattered``: under sequence parallelism, its partial sums reduce-scattered to this rank's slice of the
    sequence instead (``regions.reduce_scatter_in_place``, Megatron's ``reduce_scatter_embeddings``)."""

    def __init__(self, scattered: bool = False):
        super().__init__()
        self.scattered = scattered

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not looks_up_rows(module):
            return _dtensor_embedding(module, device_mesh)
        reduce = reduce_scatter_in_place if self.scattered else reduce_from_region
        shard_params(module, device_mesh, {"weight": Shard(0)}, self.src_data_rank)
        rows = local_index(module.weight, 0)
        start, end = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 0)
        padding = module.padding_idx
        local_padding = padding - start if padding is not None and start <= padding < end else None
        params, outside = LocalParams(), []
        norm = lookup_norm(module)  # Inkling's embed_norm: the rows summed before it, not after

        def summed(out):
            return reduce(out.masked_fill(outside.pop().unsqueeze(-1), 0), device_mesh)

        def enter(mod, args, kwargs):
            key = "input" if "input" in kwargs else "input_ids"
            ids = args[0] if args else kwargs[key]
            masked = (ids < start) | (ids >= end)
            outside.append(masked)
            local_ids = (ids - start).masked_fill(masked, 0)
            params.swap(mod, "weight", local_view(mod.weight))
            mod.padding_idx = local_padding
            return ((local_ids, *args[1:]), kwargs) if args else (args, {**kwargs, key: local_ids})

        def leave(mod, args, kwargs, out):
            params.restore()
            mod.padding_idx = padding
            return out if norm else summed(out)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True)
        if norm:  # the lookup is the norm's input: masked and summed there, the norm on whole rows
            module.get_submodule(norm).register_forward_pre_hook(lambda mod, args: (summed(args[0]), *args[1:]))
        return module


def _dtensor_embedding(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """torch's DTensor style for an embedding the local lookup cannot serve; its output a tensor of its own
    (models scale the embeddings in place: CTRL's ``*= sqrt(d)``)."""
    RowwiseParallel(input_layouts=Replicate())._apply(module, mesh)
    module.register_forward_hook(lambda mod, args, out: out.clone())
    return module
