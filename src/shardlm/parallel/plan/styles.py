"""The style vocabulary of a TP plan, and the one table of what each style shards.

A plan maps module FQNs to a ``Style``; ``PLACEMENTS`` says, per style, which dimension of the
module's weight and bias it shards over TP (for an ``nn.Linear``/``nn.Embedding`` layout; a
Conv1D stores its weight transposed, ``sharded_dim`` swaps it) and which activation it reads and
produces. A mixture-of-experts module (``experts``) holds 3-D parameters of model-specific
names and layouts: the plan's ``experts`` entry gives each its ``ExpertParam`` (derived by
``parallel/infer/experts.py``), which ``sharded_dim`` reads in place of a weight/bias dim; so does a
``per_channel`` module's (``parallel/infer/channels.py``). The plan
(``autotp``), the DTensor styles (``tp``), LoRA's placements, the memory estimator and
``shardlm plan``'s table all read this, so they cannot disagree.

Under sequence parallelism (``parallel.sequence_parallel``, ``plan/sequence.py``) the weights are placed
the same; only the activations between the split layers change: what this table calls "replicated"
inside a decoder block (a norm's input and output, a ``rowwise`` layer's output) is each rank's slice
of the sequence, reduce-scattered by ``rowwise`` instead of all-reduced and all-gathered where a
``colwise``/``packed_colwise`` sub-block reads it; the ``replicate*`` modules there hold whole
parameters with partial gradients (summed over TP).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement as TPPlacement

from shardlm.distributed.shards import packed_placement
from shardlm.parallel.model.hf import is_conv1d


class Style(StrEnum):
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    PACKED_COLWISE = "packed_colwise"
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    REPLICATE_GRAD_ALLREDUCE = "replicate_grad_allreduce"
    SHARDED_NORM = "sharded_norm"
    REPLICATE = "replicate"
    REPLICATE_LOCAL = "replicate_local"
    REPLICATE_OWN = "replicate_own"
    EXPERTS = "experts"
    PER_CHANNEL = "per_channel"


@dataclass(frozen=True)
class Placement:
    """What one style does to a module on the TP mesh.

    ``weight`` / ``bias``: the dimension sharded over TP (None: whole on every rank). ``reads`` /
    ``writes``: the activation it takes and gives. ``splits``: it divides the work of a layer
    (the plan's split layers). ``lora``: peft's LoRA layers on it can be placed.
    """

    weight: int | None
    bias: int | None
    reads: str
    writes: str
    splits: bool = False
    lora: bool = False
    doc: str = ""


PLACEMENTS: dict[Style, Placement] = {
    Style.COLWISE: Placement(
        0, 0, "replicated", "sharded on the last dim", splits=True, lora=True,
        doc="Linear/Conv1D sharded by output features",
    ),
    Style.ROWWISE: Placement(
        1, None, "sharded on the last dim", "replicated (all-reduced)", splits=True, lora=True,
        doc="Linear/Conv1D sharded by input features; its output is all-reduced back into the residual stream",
    ),
    Style.PACKED_COLWISE: Placement(
        0, 0, "replicated", "each fused part sharded on the last dim", splits=True, lora=True,
        doc="a fused colwise projection (qkv, gate_up, GPT-2's c_attn, Qwen3.5's q|k|v of unequal widths): "
        "each part sharded on its own",
    ),
    Style.EMBEDDING: Placement(
        0, None, "token ids", "replicated (all-reduced)",
        doc="token embedding sharded by vocabulary rows",
    ),
    Style.LM_HEAD: Placement(
        0, 0, "replicated", "logits sharded by vocabulary (a vocabulary-parallel loss)",
        doc="output projection sharded by vocabulary",
    ),
    Style.REPLICATE_GRAD_ALLREDUCE: Placement(
        None, None, "sharded per head", "sharded per head",
        doc="parameters acting per head on sharded activations (Qwen3's q_norm): gradients summed over TP",
    ),
    Style.SHARDED_NORM: Placement(
        0, None, "sharded on the last dim", "sharded on the last dim", splits=True,
        doc="an RMSNorm across a whole sharded width (OLMo-2's q_norm): the mean of squares all-reduced",
    ),
    Style.REPLICATE: Placement(
        None, None, "replicated", "replicated",
        doc="every other module owning parameters (norms, sub-blocks kept whole)",
    ),
    Style.REPLICATE_LOCAL: Placement(
        None, None, "replicated (local views)", "replicated",
        doc="a module kept whole (nothing under it split): computed on plain tensors and local views",
    ),
    Style.REPLICATE_OWN: Placement(
        None, None, "replicated (local views of its own parameters)", "replicated",
        doc="a module with parameters of its own around split children: only those are local views",
    ),
    Style.EXPERTS: Placement(
        None, None, "replicated (hidden states, routing weights)", "replicated (all-reduced)", splits=True,
        doc="fused 3-D expert parameters, each expert's intermediate dim sharded (gate and up halves each on "
        "their own); computed on local tensors, the partial sum all-reduced once (per parameter: Plan.experts)",
    ),
    Style.PER_CHANNEL: Placement(
        None, None, "split per channel or head (local views)", "split per channel or head", splits=True,
        doc="parameters acting per channel or head on a split activation (a depthwise conv1d, A_log, dt_bias), "
        "split like it; a module using them directly sees local views (per parameter: Plan.experts)",
    ),
}  # fmt: skip

# the styles that divide a layer's work between the TP ranks (the rest hold whole parameters)
SPLIT_STYLES = tuple(s for s, p in PLACEMENTS.items() if p.splits)
# the split linear layers: what LoRA can adapt, and what a kept-replicated sub-block gives up
SPLIT_LINEAR = tuple(s for s, p in PLACEMENTS.items() if p.lora)


@dataclass(frozen=True)
class ExpertParam:
    """How the ``experts`` style places one parameter of an experts module (``Plan.experts``).

    ``dim``: the dimension sharded over TP (an expert's intermediate width), None: whole on every
    rank. ``parts``: fused parts along ``dim``, each sharded on its own (2: gate and up concatenated,
    ``_StridedShard``; an interleaved ``[g0, u0, g1, u1, ...]`` layout is split plainly, parts 1).
    ``once``: whole, and added by one TP rank only (a bias after the down projection: the ranks'
    outputs are summed, so every rank adding it would add it tp times); its gradient is summed
    over TP. ``sizes``: the parts' sizes where they are unequal (a ``per_channel`` conv over
    Qwen3.5's q|k|v), each still split on its own (``shards.PartsShard``).
    """

    dim: int | None
    parts: int = 1
    once: bool = False
    sizes: tuple[int, ...] = ()

    def placement(self, shape: tuple[int, ...]) -> TPPlacement:
        """The TP placement of a parameter of ``shape`` (whole: ``Replicate``)."""
        if self.dim is None:
            return Replicate()
        return packed_placement(self.dim, self.sizes or (shape[self.dim] // self.parts,) * self.parts)


def sharded_dim(
    style: str | None, module: nn.Module, param: str, experts: dict[str, ExpertParam] | None = None
) -> int | None:
    """The dimension of ``module.<param>`` that ``style`` shards over TP, or None (whole on every
    rank). A Conv1D stores its weight ``[in, out]``: the table's ``nn.Linear`` dim is swapped.
    ``experts``: the plan's entry for an ``experts`` module (its per-parameter placements)."""
    if style is None:
        return None
    if style in (Style.EXPERTS, Style.PER_CHANNEL):
        return experts[param].dim if experts and param in experts else None
    placement = PLACEMENTS[Style(style)]
    if style == Style.LM_HEAD and param not in ("weight", "bias"):
        return 0  # the LM head's own per-token parameters (Dory's ``logit_scale``: ``infer/vocab_head.py``)
    dim = {"weight": placement.weight, "bias": placement.bias}.get(param)
    if dim is not None and param == "weight" and is_conv1d(module):
        dim = 1 - dim
    return dim


def local_shape(shape: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    """The shape of the largest rank's piece (rank 0's) when ``dim`` is split ``tp`` ways in torch's chunks
    (``rows.chunk_rows``): every rank's where tp divides it, as the plan checked for all but the vocabulary."""
    if dim is None or len(shape) <= dim:
        return shape
    return tuple(-(-s // tp) if i == dim else s for i, s in enumerate(shape))


def lora_dims(style: str) -> tuple[int | None, int | None]:
    """The TP-sharded dims of LoRA's ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` on a base
    layer of ``style``: A is split where the base splits its input, B where it splits its output."""
    weight = PLACEMENTS[Style(style)].weight
    return (1 if weight == 1 else None), (0 if weight == 0 else None)
