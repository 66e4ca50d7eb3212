"""``ShardTracker``: the torch function mode behind the trace, following which tensors are split.

Each op of the meta forward (``trace.trace_model``) passes through ``__torch_function__``, which
propagates *shardedness* from inputs to outputs: a split tensor carries its sources, the
column-parallel linears whose outputs it was computed from. Around that one rule the tracker keeps
the records the plan is built from, each concept in its own module: what cannot act on a split
tensor (``checks.py``, with what follows the channels instead: ``follow.py``), where a fused
projection is cut into parts (``parts.py``), stretches contracted over their split channels
(``wholes.py``), the channel layouts of split tensors (``layouts.py``) and the sizes that made them
(``sizes.py``), MLA's latents (``latent.py``), row-parallel outputs read back inside the split region
(``summed.py``), dropout call sites (``plan/call_sites.py``), and the answers to data-dependent questions
asked of meta tensors (``meta_answers.py``).

Also here, the head counts read off a split tensor's shape in the running module's forward: a
tensor made at such a size (a recurrent state ``zeros(batch, value.shape[-2], ...)``) is per head
at each rank's own head count, unlike ALiBi slopes made from the config's; so is a tensor broadcast
to such a size (MLA's one rope key expanded over the heads) when it belongs to a low-rank latent.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from shardlm.parallel.infer.broadcast import declare_broadcast_records, record_whole_use
from shardlm.parallel.infer.checks import check, check_emptied, check_reduction
from shardlm.parallel.infer.follow import declare_follow_records, record_param_dims
from shardlm.parallel.infer.head_einsums import declare_head_einsum_records, head_einsum
from shardlm.parallel.infer.head_inputs import declare_head_input_records, per_rank_product, whole_use
from shardlm.parallel.infer.head_inputs import follow as follow_head_input
from shardlm.parallel.infer.latent import check_latent, declare_latent_records
from shardlm.parallel.infer.layouts import declare_layout_records, propagate
from shardlm.parallel.infer.meta_answers import asks_data, meta_answer
from shardlm.parallel.infer.narrowed import declare_narrowed_records
from shardlm.parallel.infer.parts import (
    SPLIT_OPS,
    declare_parts_records,
    record_head_view,
    record_heads_cut,
    record_later_split,
    record_slice,
)
from shardlm.parallel.infer.sizes import declare_sizes_records, record_made, record_uses, split_attributes
from shardlm.parallel.infer.summed import declare_summed_records, direct_product, track
from shardlm.parallel.infer.wholes import declare_whole_records, hold_whole, record_contraction
from shardlm.parallel.plan.call_sites import drawn_sizes, dropout_input_shape, dropout_p, is_call_site

_VIEW_OPS = {"view", "reshape", "unflatten"}
_BROADCAST_OPS = {"expand", "broadcast_to", "repeat", "tile"}  # a tensor made at a size passed in
_SHAPE = torch._C.TensorBase.shape  # ``t.shape`` reaches the mode as this descriptor's ``__get__``


def _row_index(index) -> bool:
    """Whether ``weight[index]`` reads whole rows: an int, or an int then ``:`` (``runtime/row_reads.py``)."""
    if isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None):
        index = index[0]
    return isinstance(index, int) and not isinstance(index, bool)


class ShardTracker(TorchFunctionMode):
    """Propagates 'sharded across TP ranks' through every torch op of a meta forward.

    Each sharded tensor carries its *sources*: the column-parallel linears whose outputs it was
    computed from. When something cannot act on a sharded tensor (a parameter of a module that
    is not split with it, a per-head tensor that is not split with the heads), the sources are
    recorded as a violation: ``trace_model`` then keeps that whole sub-block replicated.
    """

    def __init__(
        self, param_owner: dict[int, str] | None = None, legit: dict | None = None, heads=(), wholes=frozenset()
    ) -> None:
        super().__init__()
        self.sharded: dict[int, frozenset[str]] = {}
        self.keep: list[torch.Tensor] = []  # keeps traced tensors alive so ids stay unique
        self.param_owner = param_owner or {}
        # head counts read off split tensors' shapes in the running module's forward, and the tensors
        # made from such sizes (a recurrent state ``zeros(batch, value.shape[-2], ...)``): per head, but
        # made at each rank's own head count, unlike ALiBi slopes made from the config's
        self.shape_heads: set[int] = set()
        self.from_split_shape: set[int] = set()
        self.legit = legit if legit is not None else {}  # fqns whose parameters may meet sharded tensors
        self.heads = {h for h in heads if h > 1}
        self.violations: list[tuple[frozenset[str], str]] = []
        self.seq: int | None = None  # the trace's sequence length (``checks.check_emptied``)
        self.first_view: dict[int, tuple[int, ...]] = {}  # id(tensor) -> shape of its first view/reshape
        self.widths: dict[str, int] = {}  # column-parallel linear -> its output width
        self.running: list[str] = []  # modules whose forward is running, innermost last
        self.foreign: dict[str, str] = {}  # owner of a parameter -> the module whose forward used it
        # module -> owner of a tied embedding whose rows its forward reads by index (Gemma 4's multimodal
        # forward reads ``embed_tokens.weight[pad_token_id]``): ``runtime/row_reads.py`` serves them
        self.row_reads: dict[str, str] = {}
        self.tied: set[int] = set()  # parameters registered in several modules (tied embeddings)
        # a tied parameter -> {module: its owner label} (Zamba's one shared transformer block, registered in
        # every hybrid layer): used inside one of those modules, it is that module's (``owner``)
        self.tied_owners: dict[int, dict[str, str]] = {}
        # parameters a module's forward returns (GPT-NeoX-Japanese's attention returns its
        # ``dense_bias`` for the layer to add): the caller receives the local view its style made
        self.returned: set[int] = set()
        # id(tensor) -> owners of the parameters it is computed from alone (DiffLlama's
        # ``exp(sum(lambda_q1 * lambda_k1))``): such a tensor meeting split activations is a parameter
        # meeting them (each rank would compute its gradient from its own heads only)
        self.from_params: dict[int, frozenset[str]] = {}
        self.from_param_ids: dict[int, frozenset[int]] = {}  # the same tensors -> ids of those parameters
        self.inside: list[str] = []  # running modules whose own math on split tensors is handled by their style
        # running modules with one parameter of the split width, judged by their ops (name, the violation
        # recorded if one of them cannot act on the split, where in ``violations``): a norm over groups
        # the split keeps whole (each rank reducing its own groups) has its weight follow the channels
        self.deferred: list[tuple[str, tuple[frozenset[str], str], int]] = []
        # per call site (dropout, a random draw): (input sharded, its shape, its probability, its sharded dim
        # where the site tells it: a draw sized by a split attribute, Reformer's ``randn(self.num_attention_heads,
        # ...)`` rotations, each rank drawing its heads' part of the one-process draw)
        self.dropout_sites: list[tuple[bool, tuple[int, ...], float, int | None]] = []
        declare_whole_records(self, wholes)
        declare_follow_records(self)
        declare_latent_records(self)
        declare_summed_records(self)
        declare_parts_records(self)
        declare_sizes_records(self)
        declare_layout_records(self)
        declare_head_input_records(self)
        declare_broadcast_records(self)
        declare_narrowed_records(self, frozenset())
        declare_head_einsum_records(self)

    def _record_dropout(self, func, args, kwargs) -> None:
        """A call site (``call_sites.is_call_site``: dropout, a random draw): is its input sharded, its
        shape, its p."""
        if is_call_site(func):
            x = args[0] if args else kwargs.get("input", kwargs.get("query"))
            sharded = any(self.is_sharded(t) for t in tree_flatten((args, kwargs))[0])
            sized = split_attributes(self.int_uses, drawn_sizes(args, kwargs) if func is torch.randn else ())
            dim = next((d for d, v in enumerate(sized) if v is not None), None)
            shape, p = dropout_input_shape(func, args, kwargs, x), dropout_p(func, args, kwargs)
            self.dropout_sites.append((sharded or dim is not None, shape, p, dim))

    def mark(self, t: torch.Tensor, sources: frozenset[str] | None) -> None:
        self.keep.append(t)
        if sources:
            self.sharded[id(t)] = sources
        else:
            self.sharded.pop(id(t), None)

    def is_sharded(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.sharded

    def sources(self, t) -> frozenset[str]:
        return self.sharded.get(id(t), frozenset()) if isinstance(t, torch.Tensor) else frozenset()

    def owner(self, pid: int) -> str:
        """The owner label of parameter ``pid``: the running module where it is one of a tied parameter's
        registrants (each hybrid layer's copy of Zamba's shared block runs its own style), else its owner."""
        tied = self.tied_owners.get(pid, {})
        here = self.running[-1] if self.running else None
        return tied[here] if here in tied else self.param_owner.get(pid, "?")

    def owners(self, t: torch.Tensor) -> frozenset[str]:
        """Owners of the parameter ``t`` or of the parameters it is computed from alone."""
        if isinstance(t, nn.Parameter):
            return frozenset({self.owner(id(t))})
        return self.from_params.get(id(t), frozenset())

    def param_ids(self, t: torch.Tensor) -> frozenset[int]:
        return frozenset({id(t)}) if isinstance(t, nn.Parameter) else self.from_param_ids.get(id(t), frozenset())

    def _record_reads(self, func, name: str, args: tuple, flat: list, inputs: list, out) -> None:
        """What an op's inputs tell before any split is propagated: head counts read off split shapes and
        the tensors made from them, every tensor kept alive, each tensor's first consumer, parameters
        used by a forward other than their owner's (``foreign``)."""
        if (getattr(func, "__self__", None) is _SHAPE or name == "size") and self.is_sharded(args[0]):
            self.shape_heads |= {n for n in args[0].shape if n in self.heads}
        elif not inputs and isinstance(out, torch.Tensor) and self.shape_heads & set(_ints(flat)):
            self.from_split_shape.add(id(out))
        elif not inputs and isinstance(out, torch.Tensor) and any(split_attributes(self.int_uses, flat)):
            self.from_split_shape.add(id(out))  # MiniMax's ``zeros(batch, self.num_attention_heads, ...)``
        elif name in _BROADCAST_OPS and isinstance(out, torch.Tensor) and _over_heads(args[0], out, flat, self):
            # one tensor shared by all heads, per rank: MLA's rope key expanded to a head count read off a split
            # shape; Reformer's ``arange(seq).repeat(batch, self.num_attention_heads, 1)``, to a split attribute
            self.from_split_shape.add(id(out))
        # every tensor seen stays alive until the trace ends: records are keyed by id(), and a
        # freed tensor's id can be reused (that made packed detection nondeterministic)
        self.keep.extend(inputs)
        self.keep.extend(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        for t in inputs:
            self.first_consumer.setdefault(id(t), (name, args[1:] if args and args[0] is t else args))
            if (
                isinstance(t, nn.Parameter)
                and id(t) in self.param_owner
                # a tied embedding is used by two modules; a row read of it elsewhere is recorded
                # (Gemma 4's multimodal forward reads embed_tokens.weight[pad_token_id]: ``row_reads``)
                and (id(t) not in self.tied | self.returned or (name == "__getitem__" and id(t) in self.tied))
                and self.running
                # reading its metadata (Mamba2's ``self.lm_head.weight.dtype``) does not use its values
                and not (name == "__get__" and not isinstance(out, torch.Tensor))
            ):
                owner = self.param_owner[id(t)]
                if owner.split(" (")[0] == self.running[-1]:
                    continue
                if name == "__getitem__" and id(t) in self.tied and _row_index(args[1]):
                    self.row_reads.setdefault(self.running[-1], owner)
                else:
                    self.foreign.setdefault(owner, self.running[-1])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if asks_data(name, args):
            return meta_answer(name, args, kwargs)
        self._record_dropout(func, args, kwargs)
        out = func(*args, **kwargs)
        flat = tree_flatten((args, kwargs))[0]
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        self._record_reads(func, name, args, flat, inputs, out)
        if record_made(name, args, kwargs, out, self.made):
            self.keep.append(out)
        if direct_product(self, name, args, out):
            return out  # a linear's column-parallel output (``summed.py``)
        if name == "einsum" and head_einsum(self, args, out):
            return out  # an einsum of a per-head parameter, split by heads like a linear (``head_einsums.py``)
        if name in _VIEW_OPS and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            self.first_view.setdefault(id(args[0]), tuple(out.shape))
            record_head_view(self, args[0], out)
        elif isinstance(out, torch.Tensor) and len(inputs) > 1:
            for t in inputs:
                if t.shape == out.shape and t is not out and all(u is t or self.owners(u) for u in inputs):
                    self.biased.setdefault(id(t), id(out))
        if name == "__getitem__" and args and isinstance(args[0], torch.Tensor):
            record_slice(self, args[0], args[1])
        sources = frozenset().union(*(self.sharded.get(id(t), frozenset()) for t in inputs))
        if not sources:
            follow_head_input(self, inputs, out)  # MPT's position bias sliced inside its attention
            per_rank_product(self, inputs, out)  # MiniMax's ``state * block_decay``
            whole_use(self, inputs)  # CPM-Ant's position bias, with gradients, added to whole scores
        track(self, name, inputs, sources, out)
        if inputs and not sources and all(self.owners(t) for t in inputs):
            owners = frozenset().union(*(self.owners(t) for t in inputs))
            ids = frozenset().union(*(self.param_ids(t) for t in inputs))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.from_params[id(t)] = owners
                    self.from_param_ids[id(t)] = ids
            record_param_dims(self, func, name, args, out)  # a transposed parameter's dims (Inkling 2's taps)
        elif inputs and not sources:
            record_whole_use(self, inputs)
        if name in SPLIT_OPS and len(sources) == 1 and args and isinstance(args[0], torch.Tensor):
            record_later_split(self, name, next(iter(sources)), args, kwargs)
        elif name in SPLIT_OPS and len(sources) > 1 and args and isinstance(args[0], torch.Tensor):
            record_heads_cut(self, name, sources, args, kwargs, out)
        # a latent's split reader's output (``sharded``) carries whole gradients on its rows: no longer the latent's
        latent = frozenset().union(*(self.latent.get(id(t), frozenset()) for t in inputs if id(t) not in self.sharded))
        if latent:
            check_latent(self, name, inputs, latent)
            if not sources:  # still whole on every rank: its gradient is still a partial one
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self.latent[id(t)] = latent
        if sources:
            propagate(name, args, kwargs, out, self.layouts, self.cuts)
            record_uses(name, args, kwargs, out, self.layouts, self.int_uses)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and id(t) in self.layouts and self.running:
                    self.split_sizes.setdefault(self.running[-1], set()).add(t.shape[self.layouts[id(t)][0]])
            if not self.inside:
                check(self, name, inputs, sources, args, kwargs, out)
                check_reduction(self, name, args, kwargs, sources)
                check_emptied(self, name, args, out, sources)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark(t, sources)
            if name == "einsum":
                record_contraction(self, args)
            if self.wholes:
                hold_whole(self, out)
        elif inputs and any(id(t) in self.whole_ids for t in inputs):
            self.whole_ids |= {id(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
            record_uses(name, args, kwargs, out, self.layouts, self.int_uses)  # B.view(.., n_groups, state)
        return out


def _over_heads(t, out: torch.Tensor, flat: list, tracker: ShardTracker) -> bool:
    """Whether ``out`` broadcasts ``t`` (unsplit) along a dim of size 1 to a head count read off a
    split tensor's shape (MLA's ``k_rot.expand(-1, k_nope.shape[1], -1, -1)``, its single rope key
    shared by every head) or given by an attribute sizing split dims (Reformer's ``offsets.expand((batch,
    self.num_attention_heads, ...))``): made at each rank's own head count (like an MQA key repeated)."""
    if not isinstance(t, torch.Tensor) or tracker.is_sharded(t):
        return False
    if t.requires_grad and id(t) not in tracker.latent:
        return False  # its gradient, from this rank's heads only, would not be summed over TP
    counts = tracker.shape_heads & set(_ints(flat[1:])) | set(split_attributes(tracker.int_uses, flat[1:])) - {None}
    lead = out.dim() - t.dim()
    return any(n in counts and (i < lead or t.shape[i - lead] == 1) for i, n in enumerate(out.shape))


def _ints(values) -> list[int]:
    """The ints among ``values`` and inside the tuples (sizes) among them."""
    out = []
    for v in values:
        if isinstance(v, (tuple, list)):
            out.extend(_ints(v))
        elif type(v) is int:
            out.append(v)
    return out
