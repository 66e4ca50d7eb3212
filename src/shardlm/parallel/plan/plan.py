"""The tensor-parallel plan of one model at one TP degree: what ``autotp`` derives, what the
styles (``runtime/``), LoRA, the estimator and ``shardlm plan`` read."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.parallel.model.geometry import Geometry
from shardlm.parallel.plan.styles import ExpertParam


@dataclass
class Plan:
    """The inferred plan plus what was learned on the way (packed part sizes, attention modules)."""

    styles: dict[str, str] = field(default_factory=dict)
    parts: dict[str, list[int]] = field(default_factory=dict)  # packed_colwise fqn -> part sizes
    # packed_colwise fqn or per_channel parameter fqn -> per part, whether it is held whole on every rank
    # (Mamba-2's B and C at n_groups < tp: summed over their state dim, ``wholes.record_contraction``)
    whole_parts: dict[str, list[bool]] = field(default_factory=dict)
    attention: list[str] = field(default_factory=list)  # modules holding sharded heads (geometry)
    agrees_with_hf: dict[str, bool] = field(default_factory=dict)  # fqn -> same direction as HF plan
    # fqn -> per TP rank, the (start, stop) output rows it computes; parameters stored replicated
    sliced: dict[str, list[list[tuple[int, int]]]] = field(default_factory=dict)
    # colwise fqn -> per TP rank, the (start, stop) output rows it computes and stores, where they are not its
    # chunk of the output (Zaya's value of two projections viewed into heads: ``infer/joined_heads.py``); a rank
    # may hold all of a linear, part of it, or none (``shards.RowsShard``)
    stored_rows: dict[str, list[list[tuple[int, int]]]] = field(default_factory=dict)
    kv_heads: tuple[int, int] = (0, 0)  # (global kv heads, kv heads per rank) of attention modules
    # linear fqn -> why its sub-block stays replicated (a layer inside it cannot be split yet)
    replicated: dict[str, str] = field(default_factory=dict)
    # per dropout call site of a forward, in call order (``parallel/runtime/dropout.py``): the dim along which its
    # input is sharded across TP ranks, None where it is replicated, -1 where sharded on no one dim
    # (or not resolved: p was 0 there when traced, see ``_dropout_dims``)
    dropout_sites: list[int | None] = field(default_factory=list)
    # ``experts`` module fqn -> {parameter name: its placement} (``parallel/infer/experts.py`` derives it)
    # ``per_channel`` modules' entries too (``parallel/infer/channels.py``): dim 0 split like their source, or None
    experts: dict[str, dict[str, ExpertParam]] = field(default_factory=dict)
    # ``per_channel`` module fqn -> {parameter: the column-parallel linear whose channels it acts on}
    channels: dict[str, dict[str, str]] = field(default_factory=dict)
    # ``per_channel`` parameter fqn -> the parts of the channels it meets, where they are not one linear's
    # whole output (``parallel/infer/layouts.py``: LFM's conv over one third of in_proj, OLMo-hybrid's over q|k|v),
    # and, where those parts are unequal, every rank's rows of it (stored whole, each rank using its rows)
    channel_parts: dict[str, list[int]] = field(default_factory=dict)
    channel_rows: dict[str, list[list[tuple[int, int]]]] = field(default_factory=dict)
    # ``per_channel`` parameter fqn -> its dim along the channels where that is not its first dim longer than 1
    # (``rows.lead_dim``): Inkling 2's dynamic conv taps, stored [kernel, channels], split along dim 1
    channel_dims: dict[str, int] = field(default_factory=dict)
    # module fqn -> {int attribute its forward reads: its value on one rank} (a mixer's ``key_dim``)
    local_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    # MLA (``latent.py``): module reading a low-rank latent kept whole (a column-parallel up-projection,
    # a norm) -> that latent; their input gradients are partial, summed over TP at the latent's input
    latent_readers: dict[str, str] = field(default_factory=dict)
    # row-parallel linears whose whole output is read back inside the split region (Mamba's x_proj:
    # ``summed.py``): the backward of their output's all-reduce sums its partial gradient over TP
    summed: list[str] = field(default_factory=list)
    # the model's sizes, read once from its config (``model/geometry.py``): the row slicing, the local
    # head counts and the estimate read them here
    geometry: Geometry = field(default_factory=Geometry)
    # split attention module -> {its argument (position or name): the heads dim} of a per-head tensor
    # built outside it from the config's head count (BLOOM's ALiBi bias): each rank sees its heads' rows
    head_inputs: dict[str, dict[int | str, int]] = field(default_factory=dict)
    # replicated parameters (of a ``replicate_own`` module) from which one whole tensor is computed and
    # broadcast over split heads (DiffLlama's lambdas, ``parallel/infer/broadcast.py``): each rank's
    # gradient comes from its heads only, summed over TP
    partial_grads: list[str] = field(default_factory=list)
    # module -> the vocabulary-parallel input embedding whose rows its forward reads by index (Gemma 4's
    # multimodal forward reads ``embed_tokens.weight[pad_token_id]``): served whole (``runtime/row_reads.py``)
    row_reads: dict[str, str] = field(default_factory=dict)
    # module kept whole -> (the module whose forward reads its parameters directly, around split layers, and
    # why it is whole): local views of them while that module runs (``parallel/infer/direct_reads.py``)
    direct_reads: dict[str, tuple[str, str]] = field(default_factory=dict)
    # a sparse-attention indexer (DSA's, Qwen4-Exp's QSA: ``parallel/infer/indexer.py``) -> the factor its summed
    # scores take: its query heads split, each rank's sum of its heads' scores all-reduced over TP and multiplied
    # by it before its top-k (``runtime/indexer.py``), one process's scores (DSA's: tp ** -0.5; QSA's: 1)
    indexers: dict[str, float] = field(default_factory=dict)
    # attentions of one shared key=value head (DeepSeek-V4's, ``parallel/infer/shared_kv.py``): their query heads
    # split, the key=value head and its compressor whole on every rank, their gradients summed over TP
    shared_kv: list[str] = field(default_factory=list)
    # row-parallel linears whose all-reduced output, one value per head (Doge's ``dt_proj``), each rank narrows
    # to its heads' columns, the gradients of the columns summed over TP (``parallel/infer/narrowed.py``)
    narrowed: list[str] = field(default_factory=list)
    # split attention module -> the whole width its forward reshapes its heads' output to, read off its whole
    # input's size() (TrOCR's ``embed_dim``): each rank reshapes to its share (``plan/local_reshape.py``)
    local_reshapes: dict[str, int] = field(default_factory=dict)
    # attention computing with einsums of per-head parameters, no linear (XLNet's; ``infer/head_einsums.py``) ->
    # {parameter: ``reads_whole`` (its einsum reads a whole input: that input's gradient summed over TP) or
    # ``sums_heads`` (its einsum sums over the heads: the ranks' partial outputs summed over TP)}
    head_einsums: dict[str, dict[str, str]] = field(default_factory=dict)
    # the outermost modules whose forwards never ran in the trace (``infer/unrun.py``): stored whole on every rank,
    # or split like a traced attention of their class (``split_like``)
    unrun: list[str] = field(default_factory=list)
