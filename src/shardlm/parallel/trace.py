"""The trace behind AutoTP: one forward on the meta device that tracks which tensors are split.

The algorithm (no table of model names): run one forward of the model on the meta device
under a ``TorchFunctionMode`` that tracks which tensors are *sharded* across TP ranks. A
linear layer that reads an unsharded tensor becomes column-parallel and its output is
sharded; every op propagates shardedness from inputs to outputs; a linear that reads a
sharded tensor becomes row-parallel and its output, all-reduced, is unsharded again. This is
the Megatron pairing (q/k/v/gate/up/fc1 -> o/down/fc2) found from the dataflow, so parallel
attention+MLP blocks (GPT-NeoX, Falcon) and models with no hand-written plan (OPT, GPT-2)
need nothing special. The first op that consumes a colwise output tells whether the
projection is fused: a split/chunk/slice of the last dim means packed parts (GPT-2 c_attn,
Phi-3 qkv_proj and gate_up_proj); a view into heads means per-head interleaving (GPT-NeoX),
which plain column sharding already keeps whole. A module with parameters that reads a
sharded tensor gets ``replicate_grad_allreduce``, unless its parameter spans the sharded
width (OLMo-2's full-width q/k norm): an RMSNorm there becomes ``sharded_norm`` (anything
else is a violation, below). A parameter (or a tensor computed from one alone) whose first dim
is the output width of the one column-parallel linear a split tensor came from, meeting that
tensor along its channel dim (a depthwise convolution with ``groups`` equal to it, or a broadcast
elementwise op), *follows* the split (``ShardTracker._follows``; ``channels.py`` splits it the
same way): Qwen3.5 DeltaNet's conv1d weight, ``A_log``, ``dt_bias``. A fused projection whose
output is cut into parts only later, after such per-channel ops (DeltaNet's q/k/v, convolved
first), is found packed at that cut (``later_parts``); a cut of a stretch of a linear's output
(Mamba-2's x|B|C, cut again after its conv) refines that linear's parts (``layouts.Cuts``). A
stretch an einsum sums over its split channels (Mamba-2's B and C with fewer groups than tp) is
held whole on every rank and the model traced again (``ShardTracker.wholes``); a module with one
parameter of the split width is judged by its ops (``ShardTracker.deferred``: a norm over groups
the split keeps whole has its weight follow the channels). A tensor made at a size read off a split
tensor's shape (a recurrent state ``zeros(batch, value.shape[-2], ...)``) is per head at each
rank's own head count, unlike ALiBi slopes made from the config's; so is a tensor broadcast to
such a size (MLA's one rope key expanded over the heads) when it belongs to a low-rank latent
(``latent.py``: its gradient is summed over TP at the latent's input). A row-parallel output read
back inside the split region (Mamba-1's ``x_proj``: whole dt, B, C meeting each rank's channels)
has its gradient summed over TP, and a linear whose weight its parent multiplies directly there
(``dt_proj.weight @ dt``) is column-parallel (``summed.py``). The model's own
``base_model_tp_plan`` is used as a cross-check of the colwise/rowwise directions.

Data-dependent questions modeling files ask (``pad_token_id in input_ids``, ``mask.all()``,
``.item()``, ``nonzero``) are answered on meta without data (``_DATA_DEPENDENT``); the trace
uses batch 1 and a prime sequence length (``TRACE_SEQ``) so per-head and per-position sizes
cannot be confused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from shardlm.parallel.dropout import dropout_input_shape, dropout_p, is_dropout_call
from shardlm.parallel.hf import (
    all_head_widths,
    gates_before_norm,
    head_counts,
    is_conv1d,
    is_linear,
    out_features,
    rms_norm_eps,
)
from shardlm.parallel.latent import latent_candidates
from shardlm.parallel.layouts import Cuts, Layout, lead_dim, propagate
from shardlm.parallel.sizes import NamedInt, record_uses
from shardlm.parallel.summed import direct_product, track, track_output

# torch ops by which a consumer cuts a fused projection's output into parts along the last dim
_SPLIT_OPS = {"split", "chunk", "split_with_sizes", "tensor_split", "unbind"}
_VIEW_OPS = {"view", "reshape", "unflatten"}
_BROADCAST_OPS = {"expand", "broadcast_to", "repeat", "tile"}  # a tensor made at a size passed in
# answers for data-dependent questions a modeling file asks of a meta tensor during the trace
# ("is a pad token in input_ids?", "is this a packed sequence?"): meta tensors hold no data
_DATA_DEPENDENT = {
    "item": 0,
    "__bool__": False,
    "__int__": 0,
    "__index__": 0,
    "__float__": 0.0,
    "tolist": [],
    "__contains__": False,
    "equal": False,
    "allclose": False,
    "is_nonzero": False,
}
_NO_ROWS = {"nonzero", "argwhere"}  # data-dependent shapes: answered as "no element matches"
# ops that reduce along a dim: over the split width of a flat column-parallel output, each rank
# would reduce its own columns only (a parameter-free norm, a softmax gate)
_REDUCTIONS = {
    "sum", "mean", "softmax", "log_softmax", "norm", "var", "std", "var_mean", "std_mean", "amax", "amin",
    "max", "min", "argmax", "argmin", "topk", "sort", "argsort", "cumsum", "cumprod", "logsumexp", "prod",
    "layer_norm", "rms_norm", "group_norm", "normalize", "vector_norm", "linalg_vector_norm",
}  # fmt: skip
RUNNING_NOTE = "while running "  # the note ``trace_model`` adds to an exception: the module whose forward raised it
_SHAPE = torch._C.TensorBase.shape  # ``t.shape`` reaches the mode as this descriptor's ``__get__``
TRACE_SEQ = 13  # a prime, unlikely to equal a head count, so per-head tensors are told from per-position ones


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
        # stretches of linears' outputs held whole on every rank, (linear, first column, width): found
        # contracted over their split channels by a previous trace (``_record_contraction``), and found now;
        # the tensors cut to one of them, and those computed from such tensors alone
        self.wholes: frozenset[tuple[str, int, int]] = frozenset(wholes)
        self.found_wholes: set[tuple[str, int, int]] = set()
        self.whole_ids: set[int] = set()
        self.buffers: dict[int, str] = {}  # id(buffer) -> its fqn
        self.buffer_follows: dict[str, tuple[frozenset[str], None]] = {}  # see ``_buffer_follows``
        self.sharded: dict[int, frozenset[str]] = {}
        self.keep: list[torch.Tensor] = []  # keeps traced tensors alive so ids stay unique
        self.first_consumer: dict[int, tuple[str, tuple]] = {}
        self.slices: dict[int, set[int]] = {}
        self.param_owner = param_owner or {}
        self.params: dict[int, nn.Parameter] = {}  # id -> parameter (``follows``)
        # head counts read off split tensors' shapes in the running module's forward, and the tensors
        # made from such sizes (a recurrent state ``zeros(batch, value.shape[-2], ...)``): per head, but
        # made at each rank's own head count, unlike ALiBi slopes made from the config's
        self.shape_heads: set[int] = set()
        self.from_split_shape: set[int] = set()
        self.legit = legit if legit is not None else {}  # fqns whose parameters may meet sharded tensors
        self.heads = {h for h in heads if h > 1}
        self.violations: list[tuple[frozenset[str], str]] = []
        self.first_view: dict[int, tuple[int, ...]] = {}  # id(tensor) -> shape of its first view/reshape
        # id(tensor) -> id of the first tensor of its shape computed from it and parameters alone (a
        # per-channel bias added: Kimi-Linear's forget gate ``f_b_proj(...) + dt_bias``), for ``latent.py``
        self.biased: dict[int, int] = {}
        self.widths: dict[str, int] = {}  # column-parallel linear -> its output width
        self.running: list[str] = []  # modules whose forward is running, innermost last
        self.foreign: dict[str, str] = {}  # owner of a parameter -> the module whose forward used it
        self.tied: set[int] = set()  # parameters registered in several modules (tied embeddings)
        # parameters a module's forward returns (GPT-NeoX-Japanese's attention returns its
        # ``dense_bias`` for the layer to add): the caller receives the local view its style made
        self.returned: set[int] = set()
        # id(tensor) -> owners of the parameters it is computed from alone (DiffLlama's
        # ``exp(sum(lambda_q1 * lambda_k1))``): such a tensor meeting split activations is a parameter
        # meeting them (each rank would compute its gradient from its own heads only)
        self.from_params: dict[int, frozenset[str]] = {}
        self.from_param_ids: dict[int, frozenset[int]] = {}  # the same tensors -> ids of those parameters
        # a parameter acting per channel (or per head) on split activations (a depthwise conv's weight,
        # Mamba's/DeltaNet's A_log, dt_bias): id(param) -> (the column-parallel linears they came from,
        # the parts of their channel layout, or None: the one linear's whole output)
        self.follows: dict[int, tuple[frozenset[str], tuple[int, ...] | None]] = {}
        self.layouts: dict[int, Layout] = {}  # id(split tensor) -> its channel layout (``layouts.py``)
        self.cuts = Cuts()  # origins of split tensors in their linear's columns, and where those were cut
        self.follow_origins: dict[int, tuple[str, int]] = {}  # id(param) -> origin of the channels it follows
        # module -> sizes of the split dims of the tensors its own code made (a mixer's key_dim, num_k_heads)
        self.split_sizes: dict[str, set[int]] = {}
        self.int_uses: dict[str, dict[str, set[str]]] = {}  # ``sizes.record_uses``
        # column-parallel linear -> part sizes, where a tensor computed from its output alone is cut
        # along its width later on (Qwen3.5's qkv: transposed, convolved, transposed back, then split)
        self.later_parts: dict[str, list[int]] = {}
        self.inside: list[str] = []  # running modules whose own math on split tensors is handled by their style
        # running modules with one parameter of the split width, judged by their ops (name, the violation
        # recorded if one of them cannot act on the split, where in ``violations``): a norm over groups
        # the split keeps whole (each rank reducing its own groups) has its weight follow the channels
        self.deferred: list[tuple[str, tuple[frozenset[str], str], int]] = []
        # per dropout call: (input sharded, its shape, its probability)
        self.dropout_sites: list[tuple[bool, tuple[int, ...], float]] = []
        # MLA (``latent.py``): id(tensor) -> the latents (linears kept whole) it is computed from while
        # still whole on every rank; the modules with parameters reading such tensors; why a latent's
        # partial gradients would reach something computed whole on every rank (then it is not one)
        self.latent: dict[int, frozenset[str]] = {}
        self.latent_readers: dict[str, frozenset[str]] = {}
        self.latent_leaks: dict[str, str] = {}
        # ``summed.py``: the weights of block linears a parent may multiply directly (id -> linear), those
        # found so; id(tensor) -> the row-parallel linears whose whole output it is computed from alone,
        # those whose region meets split activations, the modules with parameters reading it, its leaks
        self.direct_weights: dict[int, str] = {}
        self.direct: set[str] = set()
        self.rows: dict[int, frozenset[str]] = {}
        self.rows_met: set[str] = set()
        self.rows_readers: dict[str, frozenset[str]] = {}
        self.rows_leaks: dict[str, str] = {}

    def _record_dropout(self, func, args, kwargs) -> None:
        """A dropout call site (``dropout.is_dropout_call``): is its input sharded, its shape, its p."""
        if is_dropout_call(func):
            x = args[0] if args else kwargs.get("input", kwargs.get("query"))
            sharded = any(self.is_sharded(t) for t in tree_flatten((args, kwargs))[0])
            self.dropout_sites.append(
                (sharded, dropout_input_shape(func, args, kwargs, x), dropout_p(func, args, kwargs))
            )

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

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            if name in _DATA_DEPENDENT:
                return _DATA_DEPENDENT[name]
            if name in _NO_ROWS:
                if kwargs.get("as_tuple") or (len(args) > 1 and args[1] is True):
                    return tuple(torch.empty(0, dtype=torch.long, device="meta") for _ in range(args[0].dim()))
                return torch.empty((0, args[0].dim()), dtype=torch.long, device="meta")
        self._record_dropout(func, args, kwargs)
        out = func(*args, **kwargs)
        flat = tree_flatten((args, kwargs))[0]
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        if (getattr(func, "__self__", None) is _SHAPE or name == "size") and self.is_sharded(args[0]):
            self.shape_heads |= {n for n in args[0].shape if n in self.heads}
        elif not inputs and isinstance(out, torch.Tensor) and self.shape_heads & set(_ints(flat)):
            self.from_split_shape.add(id(out))
        elif name in _BROADCAST_OPS and isinstance(out, torch.Tensor) and _over_heads(args[0], out, flat, self):
            self.from_split_shape.add(id(out))  # one tensor shared by all heads (MLA's rope key), per rank
        # every tensor seen stays alive until the trace ends: records are keyed by id(), and a
        # freed tensor's id can be reused (that made packed detection nondeterministic)
        self.keep.extend(inputs)
        self.keep.extend(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        for t in inputs:
            self.first_consumer.setdefault(id(t), (name, args[1:] if args and args[0] is t else args))
            if (
                isinstance(t, nn.Parameter)
                and id(t) in self.param_owner
                and id(t) not in self.tied | self.returned
                and self.running
                # reading its metadata (Mamba2's ``self.lm_head.weight.dtype``) does not use its values
                and not (name == "__get__" and not isinstance(out, torch.Tensor))
            ):
                owner = self.param_owner[id(t)]
                if owner.split(" (")[0] != self.running[-1]:
                    self.foreign.setdefault(owner, self.running[-1])
        if direct_product(self, name, args, out):
            return out  # a linear's column-parallel output (``summed.py``)
        if name in _VIEW_OPS and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            self.first_view.setdefault(id(args[0]), tuple(out.shape))
        elif isinstance(out, torch.Tensor) and len(inputs) > 1:
            for t in inputs:
                if t.shape == out.shape and t is not out and all(u is t or self._owners(u) for u in inputs):
                    self.biased.setdefault(id(t), id(out))
        if name == "__getitem__" and args and isinstance(args[0], torch.Tensor):
            self._record_slice(args[0], args[1])
        sources = frozenset().union(*(self.sharded.get(id(t), frozenset()) for t in inputs))
        track(self, name, inputs, sources, out)
        if inputs and not sources and all(self._owners(t) for t in inputs):
            owners = frozenset().union(*(self._owners(t) for t in inputs))
            ids = frozenset().union(*(self._param_ids(t) for t in inputs))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.from_params[id(t)] = owners
                    self.from_param_ids[id(t)] = ids
        if name in _SPLIT_OPS and len(sources) == 1 and args and isinstance(args[0], torch.Tensor):
            self._record_later_split(name, next(iter(sources)), args, kwargs)
        # a latent's split reader's output (``sharded``) carries whole gradients on its rows: no longer the latent's
        latent = frozenset().union(*(self.latent.get(id(t), frozenset()) for t in inputs if id(t) not in self.sharded))
        if latent:
            self._check_latent(name, inputs, latent)
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
                self._check(name, inputs, sources, args, kwargs, out)
                self._check_reduction(name, args, kwargs, sources)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark(t, sources)
            if name == "einsum":
                self._record_contraction(args)
            if self.wholes:
                self._hold_whole(out)
        elif inputs and any(id(t) in self.whole_ids for t in inputs):
            self.whole_ids |= {id(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
            record_uses(name, args, kwargs, out, self.layouts, self.int_uses)  # B.view(.., n_groups, state)
        return out

    def _record_contraction(self, args: tuple) -> None:
        """An einsum summing a split tensor over its split dim (Mamba-2's B and C at n_groups < tp, over
        their state dim: each rank would sum its own channels only). Where that tensor is one stretch of a
        linear's output (its ``Cuts`` origin), the stretch is held whole on every rank (``found_wholes``:
        ``Plan.sliced`` rows, traced again), as kv heads fewer than tp are."""
        if not args or not isinstance(args[0], str) or "->" not in args[0] or "." in args[0]:
            return
        lhs, rhs = args[0].replace(" ", "").split("->")
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        for spec, t in zip(lhs.split(","), operands):
            layout, origin = self.layouts.get(id(t)), self.cuts.origins.get(id(t))
            if layout and origin and len(layout[1]) == 1 and len(spec) == t.dim() and spec[layout[0]] not in rhs:
                self.found_wholes.add((*origin, layout[1][0]))

    def _hold_whole(self, out) -> None:
        """Tensors cut to a stretch held whole (``wholes``): whole on every rank, no longer split."""
        for t in tree_flatten(out)[0]:
            origin, layout = self.cuts.origins.get(id(t)), self.layouts.get(id(t))
            if origin and layout and (*origin, sum(layout[1])) in self.wholes:
                self.mark(t, None)
                self.layouts.pop(id(t))
                self.whole_ids.add(id(t))

    def _check_latent(self, name: str, inputs: list[torch.Tensor], latent: frozenset[str]) -> None:
        """A latent's tensors carry partial gradients (each rank's from its own heads, summed over
        TP once, at the latent's input): meeting a tensor that needs a whole gradient (one computed
        whole on every rank, a parameter of a module that does not read the latent) would give it
        a partial one."""
        readers = tuple(f"{r} (" for r in self.latent_readers)
        for t in inputs:
            if id(t) in self.sharded or id(t) in self.latent or not t.requires_grad:
                continue
            owners = self._owners(t)
            if owners and all(o.startswith(readers) for o in owners):
                continue  # a parameter of a module reading the latent (its norm): summed over TP too
            for fqn in latent:
                self.latent_leaks.setdefault(fqn, f"{name} mixes it with a tensor computed whole on every rank")

    def _owners(self, t: torch.Tensor) -> frozenset[str]:
        """Owners of the parameter ``t`` or of the parameters it is computed from alone."""
        if isinstance(t, nn.Parameter):
            return frozenset({self.param_owner.get(id(t), "?")})
        return self.from_params.get(id(t), frozenset())

    def _param_ids(self, t: torch.Tensor) -> frozenset[int]:
        return frozenset({id(t)}) if isinstance(t, nn.Parameter) else self.from_param_ids.get(id(t), frozenset())

    def _record_later_split(self, name: str, source: str, args: tuple, kwargs: dict) -> None:
        """A split of a tensor computed from ``source``'s output alone, along a dim of its full width."""
        t, width = args[0], self.widths.get(source)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        if not isinstance(dim, int) or not t.dim() or t.shape[dim] != width or source in self.later_parts:
            return
        sizes = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("sections"))
        if name == "chunk" and isinstance(sizes, int) and sizes > 1 and width % sizes == 0:
            sizes = width // sizes  # chunk's argument is the number of parts
        if isinstance(sizes, (list, tuple)) and sum(sizes) == width and len(sizes) > 1:
            self.later_parts[source] = list(sizes)
        elif isinstance(sizes, int) and 0 < sizes < width and width % sizes == 0:
            self.later_parts[source] = [sizes] * (width // sizes)

    def _follows(
        self, name: str, t: torch.Tensor, sharded: list[torch.Tensor], args: tuple, kwargs: dict, out=None
    ) -> bool:
        """Whether ``t`` (a parameter, or computed from one alone) acts per channel on split
        activations, so that it can be split with them: its first dim meets their split dim at its
        full size (a depthwise convolution over those channels, or an elementwise op broadcasting
        it along them). Their channel layout (``layouts.py``) says how each rank's channels lie;
        without one, the first dim must be the whole width of the one linear they came from."""
        ids = self._param_ids(t)
        sources = frozenset().union(*(self.sharded[id(s)] for s in sharded))
        if len(ids) != 1:
            return False
        (pid,) = ids
        param = self.params.get(pid)
        if param is None or not param.dim() or not t.dim() or self.param_owner.get(pid) in self.legit:
            return False  # a split linear's (or norm's) own parameters: its style places them
        if name in ("conv1d", "conv2d", "convolution"):
            groups = kwargs.get("groups", args[6] if len(args) > 6 else 1)
            x = args[0] if args else kwargs.get("input")
            if x is t or x.dim() < 2 or groups != x.shape[1] or t.shape[0] != x.shape[1]:
                return False
            met, dim, tdim, spread = [x], 1 - x.dim(), 0, False
        else:
            # elementwise, broadcast: t's dims align with the trailing dims of every split input, its first on
            # their split dim, and the result has their shape (not a product or reduction over the channels)
            if not isinstance(out, torch.Tensor) or not all(
                t.dim() <= s.dim() and (_along(t, s, out) or _spread(t, s, out)) for s in sharded
            ):
                return False
            # both broadcast (Mamba's ``A[None, :, None, :] * dt[:, :, :, None]``): only along a known layout
            spread = not all(_along(t, s, out) for s in sharded)
            # its leading dims of size 1 broadcast (Kimi-Linear's ``A_log`` of shape [1, 1, heads, 1])
            met, tdim = sharded, lead_dim(t)
            dim = tdim - t.dim()
        found = {self.layouts.get(id(s)) for s in met}
        layout = found.pop() if len(found) == 1 else None
        origin = None
        if layout is not None and layout[0] == dim and sum(layout[1]) == t.shape[tdim] == param.shape[lead_dim(param)]:
            whole = len(sources) == 1 and layout[1] == (self.widths.get(next(iter(sources))),)
            follow = (sources, None if whole else layout[1])
            origins = {self.cuts.origins.get(id(s)) for s in met}
            if not whole and len(origins) == 1 and None not in origins and len(layout[1]) == 1:
                origin = origins.pop()  # its parts: those the linear's cuts make of its columns (``Cuts``)
        elif (
            len(sources) == 1
            and not spread
            and param.shape[0] == self.widths.get(next(iter(sources)))
            and (name in ("conv1d", "conv2d", "convolution") or any(a == param.shape[0] for a in t.shape))
        ):
            follow = (sources, None)  # no layout known: the source's whole width
        else:
            return False
        if self.follows.get(pid, follow) != follow:
            return False
        self.follows[pid] = follow
        if origin is not None:
            self.follow_origins[pid] = origin
        return True

    def _buffer_follows(self, t: torch.Tensor, sharded: list[torch.Tensor], out) -> bool:
        """A buffer of one column-parallel linear's output width multiplied into that whole output
        (Falcon-H1's ``mup_vector``, [1, 1, width]): it follows the linear's rows (``buffer_follows``)."""
        fqn = self.buffers.get(id(t))
        if fqn is None or not t.dim() or not isinstance(out, torch.Tensor) or len(sharded) != 1:
            return False  # a scalar buffer (XIELU's beta) multiplies every channel alike
        if out.shape != sharded[0].shape:
            return False
        sources = self.sharded[id(sharded[0])]
        (source, *rest) = sorted(sources)
        width = self.widths.get(source)
        if rest or self.layouts.get(id(sharded[0])) != (-1, (width,)) or t.shape[-1] != width or t.numel() != width:
            return False
        self.buffer_follows[fqn] = (sources, None)
        return True

    def _check(
        self, name: str, inputs: list[torch.Tensor], sources: frozenset[str], args=(), kwargs=None, out=None
    ) -> None:
        """Record what cannot act on this op's sharded input(s) as they stand."""
        sharded = [t for t in inputs if id(t) in self.sharded]
        for t in inputs:
            if id(t) in self.sharded:
                continue
            if self._follows(name, t, sharded, args, kwargs or {}, out) or self._buffer_follows(t, sharded, out):
                continue
            if isinstance(t, nn.Parameter):
                owner = self.param_owner.get(id(t), "?")
                if owner not in self.legit:
                    self.violations.append((sources, f"a parameter of {owner} acts on its split activations ({name})"))
            elif id(t) in self.from_params and not self.from_params[id(t)] <= self.legit.keys():
                owner = sorted(self.from_params[id(t)] - self.legit.keys())[0]
                self.violations.append(
                    (sources, f"a tensor computed from parameters of {owner} acts on its split activations ({name})")
                )
            elif t.dim() and t.numel() > 1 and self.heads and id(t) not in self.from_split_shape | self.whole_ids:
                for s in sharded:
                    # the heads dim of split activations is never the last (that is head_dim or keys)
                    for i in range(2, min(t.dim(), s.dim()) + 1):
                        if t.shape[-i] == s.shape[-i] and t.shape[-i] in self.heads:
                            self.violations.append(
                                (
                                    sources,
                                    f"a per-head tensor of shape {tuple(t.shape)} (ALiBi slopes, position "
                                    f"biases) is not split with the heads ({name})",
                                )
                            )
                            return

    def _check_reduction(self, name: str, args: tuple, kwargs: dict, sources: frozenset[str]) -> None:
        """A reduction over the last dim of a flat column-parallel output (its width not yet viewed
        into heads) would reduce each rank's columns only."""
        if (
            name not in _REDUCTIONS
            or not args
            or not isinstance(args[0], torch.Tensor)
            or id(args[0]) not in self.sharded
        ):
            return
        t = args[0]
        layout = self.layouts.get(id(t)) if self.deferred else None  # inside a deferred module: any split dim
        full = bool(t.dim()) and t.shape[-1] in {self.widths.get(src) for src in sources}
        if not t.dim() or not (full or layout):
            return
        if name in ("layer_norm", "rms_norm", "group_norm"):
            dims = {t.dim() - 1}
        else:
            pos = 2 if name == "topk" else 1
            dim = kwargs.get("dim", args[pos] if len(args) > pos else None)
            if isinstance(dim, torch.Tensor) or (
                name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor)
            ):
                return  # elementwise max/min of two tensors
            if dim is None and name in ("softmax", "log_softmax", "sort", "argsort", "topk", "normalize", "cumsum"):
                dim = -1
            dims = None if dim is None else {d % t.dim() for d in (dim if isinstance(dim, (tuple, list)) else [dim])}
        if dims is None or t.dim() - 1 in dims if full else layout[0] % t.dim() in dims:
            self.violations.append((sources, f"{name} over the split width {t.shape[-1]}"))

    def _record_slice(self, tensor: torch.Tensor, index) -> None:
        index = index if isinstance(index, tuple) else (index,)
        if index and index[0] is Ellipsis and len(index) == 2 and isinstance(index[1], slice):
            bounds = self.slices.setdefault(id(tensor), set())
            for b in (index[1].start, index[1].stop):
                if isinstance(b, int):
                    bounds.add(b)


def _along(t: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> bool:
    """``t`` broadcast along the split tensor ``s`` (its dims equal to or 1 against ``s``'s trailing
    ones), giving ``s``'s shape: elementwise, not a product or reduction over the channels."""
    return out.shape == s.shape and all(a == b or a == 1 for a, b in zip(t.shape, s.shape[s.dim() - t.dim() :]))


def _spread(t: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> bool:
    """``t`` and the split tensor ``s`` both broadcast into ``out`` (an outer product per channel:
    Mamba's ``A[None, :, None, :] * dt[:, :, :, None]``, each channel's state row)."""
    try:
        return out.dim() == s.dim() and out.shape == torch.broadcast_shapes(t.shape, s.shape)
    except RuntimeError:
        return False


def _over_heads(t, out: torch.Tensor, flat: list, tracker: ShardTracker) -> bool:
    """Whether ``out`` broadcasts ``t`` (unsplit) along a dim of size 1 to a head count read off a
    split tensor's shape: MLA's ``k_rot.expand(-1, k_nope.shape[1], -1, -1)``, its single rope key
    shared by every head, made at each rank's own head count (like an MQA key repeated)."""
    if not isinstance(t, torch.Tensor) or tracker.is_sharded(t):
        return False
    if t.requires_grad and id(t) not in tracker.latent:
        return False  # its gradient, from this rank's heads only, would not be summed over TP
    counts = tracker.shape_heads & set(_ints(flat[1:]))
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


def _parts_from_consumer(tracker: ShardTracker, out: torch.Tensor) -> list[int] | None:
    """Part sizes if the projection output is cut along its last dim right away, else None."""
    width = out.shape[-1]
    if id(out) in tracker.slices:
        bounds = sorted({0, width} | {b % width if b < 0 else b for b in tracker.slices[id(out)]})
        return [b - a for a, b in zip(bounds, bounds[1:])]
    name, rest = tracker.first_consumer.get(id(out), ("", ()))
    if name not in _SPLIT_OPS or not rest:
        return None
    dim = rest[1] if len(rest) > 1 else -1
    if dim not in (-1, out.dim() - 1):
        return None
    arg = rest[0]
    if name == "chunk":
        return [width // arg] * arg
    if isinstance(arg, int):
        return [arg] * (width // arg)
    return list(arg)


def _whole_flags(wholes, linear: str, start: int, parts) -> list[bool]:
    """Per part of ``linear``'s columns from ``start``: whether it is a stretch held whole."""
    flags = []
    for p in parts:
        flags.append((linear, start, p) in wholes)
        start += p
    return flags


def _refined(parts: list[int], cut: tuple[int, ...]) -> list[int]:
    """The parts both ``parts`` and ``cut`` (of the same width) make: every boundary of either."""
    bounds = {0}
    for sizes in (parts, cut):
        offset = 0
        for p in sizes:
            offset += p
            bounds.add(offset)
    edges = sorted(bounds)
    return [b - a for a, b in zip(edges, edges[1:])]


def build_meta(model: nn.Module, eager: bool = True) -> nn.Module:
    """A fresh meta copy of ``model``'s architecture (``eager``: eager attention, every op visible;
    else the attention the ranks will run)."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    if eager:
        config._attn_implementation = "eager"
    # MoE: the eager experts loop (grouped_mm cannot run on meta; every kernel computes the same)
    config._experts_implementation = "eager"
    with torch.device("meta"):
        return type(model)._from_config(config)


def meta_forward(meta: nn.Module, shape: tuple[int, int] = (1, TRACE_SEQ)) -> None:
    meta(input_ids=torch.zeros(shape, dtype=torch.long, device="meta"))


@dataclass
class Traced:
    styles: dict[str, str]
    parts: dict[str, list[int]]
    violations: list[tuple[frozenset[str], str]]
    closer_inputs: dict[str, frozenset[str]]  # rowwise linear -> sources of what it reads
    views: dict[str, tuple[int, ...]]  # colwise linear -> shape of the first view of its output
    foreign: dict[str, str]  # owner of a parameter -> another module whose forward used it directly
    dropout_sites: list[tuple[bool, tuple[int, ...], float]]  # see ``ShardTracker.dropout_sites``
    # parameter fqn -> (the column-parallel linears whose channels it acts on, their layout's parts or None)
    follows: dict[str, tuple[frozenset[str], tuple[int, ...] | None]]
    reads: dict[str, set[str]]  # module holding linears -> int attributes of its own its forward read
    split_sizes: dict[str, set[int]]  # see ``ShardTracker.split_sizes``
    int_uses: dict[str, dict[str, set[str]]]  # module -> int attribute -> what it sized (``sizes.py``)
    # stretches of linears' outputs found summed over their split channels, not yet held whole (traced
    # again with them in ``wholes``); and per packed linear or following parameter, which parts are whole
    new_wholes: set[tuple[str, int, int]]
    whole: dict[str, list[bool]]
    # column-parallel linear -> the row-parallel linear reading it whose output is then viewed into
    # heads (MLA's q_a_proj -> q_b_proj): a low-rank latent, better kept whole (``latent_candidates``)
    latents: dict[str, str]
    # with ``trace_model(latents=...)``: module reading a latent's tensors -> those latents, and
    # latent -> why its gradient cannot stay partial (``ShardTracker.latent_leaks``)
    latent_readers: dict[str, set[str]]
    latent_leaks: dict[str, str]
    # ``summed.py``: linears multiplied directly by their parent; row-parallel linears whose whole output is
    # read inside the split region (its gradient summed over TP); module with parameters reading it -> those
    direct: set[str]
    summed: set[str]
    summed_readers: dict[str, set[str]]


def trace_model(
    model: nn.Module,
    forced: frozenset[str] = frozenset(),
    meta: nn.Module | None = None,
    shape: tuple[int, int] = (1, TRACE_SEQ),
    latents: frozenset[str] = frozenset(),
    wholes: frozenset[tuple[str, int, int]] = frozenset(),
) -> Traced:
    """Directions of every linear inside the decoder blocks, packed parts, and the dropout call
    sites, from one meta forward of a ``shape`` batch; ``forced``: linears kept replicated (their
    outputs are whole on every rank); ``meta``: a meta copy of ``model`` to trace (built if not
    given; the trace leaves it as is); ``latents``: forced linears whose outputs are low-rank
    latents read per head (``latent.py``): the modules reading them and what they meet are recorded."""
    meta = meta if meta is not None else build_meta(model)
    styles: dict[str, str] = {}
    registrations: dict[int, int] = {}
    for _, m in meta.named_modules():
        for p in m.parameters(recurse=False):
            registrations[id(p)] = registrations.get(id(p), 0) + 1
    param_owner = {
        id(p): f"{m_name} ({type(m).__name__})"
        for m_name, m in meta.named_modules()
        for p in m.parameters(recurse=False)
    }
    legit: dict[str, bool] = {}
    tracker = ShardTracker(param_owner, legit, head_counts(meta.config), wholes)
    tracker.tied = {i for i, n in registrations.items() if n > 1}
    tracker.params = {id(p): p for p in meta.parameters()}
    tracker.buffers = {id(b): name for name, b in meta.named_buffers()}
    outputs: dict[str, torch.Tensor] = {}
    closer_inputs: dict[str, frozenset[str]] = {}
    hooks = []
    running: list[str] = []  # modules whose forward is running (named when an exception escapes)
    tracker.running = running
    block_prefixes = tuple(f"{name}." for name, m in meta.named_modules() if isinstance(m, nn.ModuleList))
    widths_of_heads = all_head_widths(meta.config)
    tracker.direct_weights = {
        id(m.weight): name
        for name, m in meta.named_modules()
        if is_linear(m) and name.startswith(block_prefixes) and name not in forced and not is_conv1d(m)
    }

    def pre(name):
        label = f"{name} ({{}})"

        def hook(module, args):
            running.append(name)
            tracker.shape_heads.clear()
            if not args or not isinstance(args[0], torch.Tensor):
                return
            if id(args[0]) in tracker.latent and any(True for _ in module.parameters(recurse=False)):
                tracker.latent_readers[name] = tracker.latent[id(args[0])]
            if id(args[0]) in tracker.rows and any(True for _ in module.parameters(recurse=False)):
                tracker.rows_readers[name] = tracker.rows[id(args[0])]
            sources = tracker.sources(args[0])
            owner = label.format(type(module).__name__)
            if is_linear(module) and name in forced:
                styles[name] = "replicate"
                if sources:
                    tracker.violations.append((sources, f"{owner} reads its split activations"))
            elif is_linear(module) and name.startswith(block_prefixes):
                styles[name] = "rowwise" if sources else "colwise"
                tracker.widths[name] = out_features(module)
                legit[owner] = True
                if sources:
                    closer_inputs[name] = closer_inputs.get(name, frozenset()) | sources
            elif sources and any(True for _ in module.parameters(recurse=False)):
                width = args[0].shape[-1]
                params = list(module.parameters(recurse=False))
                if all(p.dim() == 1 and p.numel() == width for p in params) and width in widths_of_heads:
                    styles[name] = "replicate_grad_allreduce"  # per head (Qwen3's q_norm/k_norm)
                    legit[owner] = True
                    tracker.inside.append(name)
                elif (
                    all(p.numel() == width for p in params)
                    and rms_norm_eps(module) is not None
                    and (len(args) < 2 or gates_before_norm(module))  # Mamba-2's gated norm, one group
                ):
                    styles[name] = "sharded_norm"  # across the whole split width (OLMo-2's q_norm)
                    legit[owner] = True
                    tracker.inside.append(name)
                else:
                    across = all(p.numel() == width for p in params)
                    why = (sources, f"{owner} {'normalizes across' if across else 'acts on'} the split width {width}")
                    if across and len(params) == 1:
                        # perhaps a norm over groups that the split keeps whole (Mamba-2's gated norm at
                        # n_groups divisible by tp): its ops decide (``ShardTracker.deferred``)
                        tracker.deferred.append((name, why, len(tracker.violations)))
                    else:
                        tracker.violations.append(why)

        return hook

    def post(name):
        def hook(module, args, out):
            if running and running[-1] == name:
                running.pop()
            if tracker.inside and tracker.inside[-1] == name:
                tracker.inside.pop()
            if tracker.deferred and tracker.deferred[-1][0] == name:
                _, why, start = tracker.deferred.pop()
                if len(tracker.violations) > start or any(id(p) not in tracker.follows for p in module.parameters()):
                    tracker.violations.insert(start, why)
            tracker.returned |= {id(t) for t in tree_flatten(out)[0] if isinstance(t, nn.Parameter)}
            if isinstance(out, torch.Tensor) and styles.get(name) in ("colwise", "rowwise", "replicate"):
                tracker.mark(out, frozenset({name}) if styles[name] == "colwise" else None)
                if styles[name] == "colwise":
                    tracker.layouts[id(out)] = (-1, (out.shape[-1],))
                    tracker.cuts.origins[id(out)] = (name, 0)
                outputs[name] = out
            track_output(tracker, name, out, styles.get(name) == "rowwise")
            if name in latents and isinstance(out, torch.Tensor):
                tracker.latent[id(out)] = frozenset({name})
            for t in tree_flatten(out)[0]:
                for fqn in tracker.latent.get(id(t), ()) if isinstance(t, torch.Tensor) else ():
                    if not name.startswith(f"{fqn.rpartition('.')[0]}."):  # it leaves the module holding it
                        tracker.latent_leaks.setdefault(fqn, f"{name} returns it")

        return hook

    for name, module in meta.named_modules():
        hooks.append(module.register_forward_pre_hook(pre(name)))
        hooks.append(module.register_forward_hook(post(name)))
    reads: dict[str, set[str]] = {}
    watched = {
        name: _watch_reads(m, reads.setdefault(name, set()), name)
        for name, m in meta.named_modules()
        if _holds_linear(m)
    }
    try:
        with tracker:
            meta_forward(meta, shape)
    except Exception as exc:
        if running:
            exc.add_note(f"{RUNNING_NOTE}{running[-1]} ({type(meta.get_submodule(running[-1])).__name__})")
        raise
    finally:
        for h in hooks:
            h.remove()
        for name, cls in watched.items():
            meta.get_submodule(name).__class__ = cls
    int_reads = {
        name: {a for a in names if type(meta.get_submodule(name).__dict__.get(a)) is int}
        for name, names in reads.items()
    }
    direct = tracker.direct - styles.keys()  # multiplied directly by its parent, its forward never run
    for fqn in direct:  # (``summed.py``)
        styles[fqn] = "colwise"
    for fqn in sorted(tracker.rows_met & tracker.rows_leaks.keys()):
        tracker.violations.append(
            (
                closer_inputs.get(fqn, frozenset()),
                f"the output of {fqn}, whole, meets its split activations and {tracker.rows_leaks[fqn]}",
            )
        )
    summed = tracker.rows_met - tracker.rows_leaks.keys()
    parts, views = {}, {}
    for name, style in styles.items():
        if style == "colwise" and name in outputs:
            views[name] = tracker.first_view.get(id(outputs[name]), ())[outputs[name].dim() :]
            found = _parts_from_consumer(tracker, outputs[name]) or tracker.later_parts.get(name)
            found = _refined(found or [outputs[name].shape[-1]], tracker.cuts.parts(name, 0, outputs[name].shape[-1]))
            if found and len(found) > 1:
                styles[name], parts[name] = "packed_colwise", found
    names = {
        id(p): f"{m_name}.{p_name}" if m_name else p_name
        for m_name, m in meta.named_modules()
        for p_name, p in m.named_parameters(recurse=False)
    }
    follows = {names[pid]: source for pid, source in tracker.follows.items()} | tracker.buffer_follows
    whole = {name: _whole_flags(wholes, name, 0, p) for name, p in parts.items()}
    for pid, (linear, start) in tracker.follow_origins.items():  # a stretch of a linear cut again later
        sources, (width,) = tracker.follows[pid]
        follows[names[pid]] = (sources, tracker.cuts.parts(linear, start, width))
        whole[names[pid]] = _whole_flags(wholes, linear, start, follows[names[pid]][1])
    return Traced(
        styles,
        parts,
        tracker.violations,
        closer_inputs,
        views,
        tracker.foreign,
        tracker.dropout_sites,
        follows,
        {name: names for name, names in int_reads.items() if names},
        tracker.split_sizes,
        tracker.int_uses,
        tracker.found_wholes - wholes,
        {name: flags for name, flags in whole.items() if any(flags)},
        latent_candidates(tracker, styles, outputs, closer_inputs),
        {name: set(fqns) for name, fqns in tracker.latent_readers.items()},
        dict(tracker.latent_leaks),
        direct,
        summed,
        {name: set(fqns & summed) for name, fqns in tracker.rows_readers.items() if fqns & summed},
    )


def _holds_linear(module: nn.Module) -> bool:
    return any(is_linear(child) for child in module.children())


def _watch_reads(module: nn.Module, names: set[str], fqn: str) -> type:
    """Record in ``names`` every attribute read on ``module`` (until its class is restored: the
    returned original). The trace learns which sizes a mixer's forward reads (``self.key_dim``),
    so that only those are made local (``Plan.local_sizes``), not a size it keeps for its cache;
    an int attribute is read as a ``NamedInt`` (``sizes.py``: what it sizes)."""
    cls = type(module)

    def __getattribute__(self, attr):  # noqa: N807 - the hook is this dunder
        names.add(attr)
        value = cls.__getattribute__(self, attr)
        return NamedInt(value, fqn, attr) if type(value) is int else value

    module.__class__ = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__})
    return cls


def dropout_dims(model: nn.Module, traced: Traced, forced: frozenset[str]) -> list[int | None]:
    """The sharded dim of each dropout site's input (see ``Plan.dropout_sites``).

    Shardedness is known per tensor, not per dim, so a second trace with another batch size and
    sequence length tells the batch/sequence dims (their sizes change) from the feature dims
    (they do not); the sharded one is the first feature dim: heads in ``[batch, heads, q, k]``
    attention probabilities, features in ``[batch, seq, ffn]`` or ``[batch*seq, ffn]``. The
    second trace runs only for a model that drops on a sharded tensor (p > 0); other sharded
    sites get -1, which ``dropout.traced_dim`` refuses should one ever draw a mask.
    """
    sites = traced.dropout_sites
    if not any(sharded and p > 0 for sharded, _, p in sites):
        return [-1 if sharded else None for sharded, _, _ in sites]
    other = trace_model(model, forced, shape=(2, 5)).dropout_sites
    if len(other) != len(sites):
        raise RuntimeError(f"dropout call sites differ between two traces ({len(sites)} vs {len(other)})")
    dims: list[int | None] = []
    for (sharded, a, _), (_, b, _) in zip(sites, other):
        fixed = [d for d in range(len(a)) if len(a) == len(b) and a[d] == b[d]]
        dims.append((fixed[0] if fixed else -1) if sharded else None)
    return dims
