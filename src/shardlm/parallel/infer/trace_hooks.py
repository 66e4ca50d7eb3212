"""The forward hooks of one trace (``trace.py``): what each module decides as its forward starts and ends.

Before a module runs (``pre``): a linear inside the decoder blocks reading an unsplit tensor becomes
column-parallel, one reading a split tensor row-parallel (its input's sources recorded); a module with
parameters reading a split tensor is a per-head norm, a norm across the split width, or a violation. After
it runs (``post``): the output of a column-parallel linear is marked split (its sources, layout and cut
origin), a latent's output tagged, what leaves its module recorded. The state the hooks fill (styles,
outputs, closer inputs, the modules running) is this object's; the tensor-level state is the tracker's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from shardlm.parallel.infer.head_inputs import record_inputs
from shardlm.parallel.infer.layouts import split_last
from shardlm.parallel.infer.narrowed import mark, record
from shardlm.parallel.infer.sizes import record_linear_input
from shardlm.parallel.infer.summed import track_output
from shardlm.parallel.infer.tracker import ShardTracker
from shardlm.parallel.model.hf import gates_before_norm, is_linear, out_features, rms_norm_eps, weightless_norm


class TraceHooks:
    """Pre- and post-forward hooks on every module of a meta model (``install``, ``remove``).

    ``forced``: linears kept replicated; ``latents``: forced linears whose outputs are low-rank latents;
    ``widths_of_heads``: head widths a per-head norm may have; ``legit``: owner label -> whether its use of
    split activations is placed (shared with the tracker)."""

    def __init__(
        self,
        tracker: ShardTracker,
        forced: frozenset[str],
        latents: frozenset[str],
        widths_of_heads: set[int],
        legit: dict[str, bool],
    ):
        self.tracker, self.forced, self.latents, self.widths_of_heads, self.legit = (
            tracker,
            forced,
            latents,
            widths_of_heads,
            legit,
        )
        self.block_prefixes: tuple[str, ...] = ()  # the decoder blocks' prefixes: their linears are split
        self.styles: dict[str, str] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.closer_inputs: dict[str, frozenset[str]] = {}  # rowwise linear -> sources of what it reads
        self.running: list[str] = []  # modules whose forward is running (named when an exception escapes)
        tracker.running = self.running
        self.ran: set[str] = set()  # modules whose forward ran (``Plan.unrun``: those that never did)
        self.handles: list = []

    def install(self, meta: nn.Module) -> None:
        for name, module in meta.named_modules():
            self.handles.append(module.register_forward_pre_hook(self.pre(name)))
            self.handles.append(module.register_forward_pre_hook(self.inputs(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self.post(name)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def pre(self, name: str):
        label = f"{name} ({{}})"

        def hook(module, args):
            self.running.append(name)
            self.ran.add(name)
            self.tracker.shape_heads.clear()
            if not args or not isinstance(args[0], torch.Tensor):
                return
            if id(args[0]) in self.tracker.latent and any(True for _ in module.parameters(recurse=False)):
                self.tracker.latent_readers[name] = self.tracker.latent[id(args[0])]
            if id(args[0]) in self.tracker.rows and any(True for _ in module.parameters(recurse=False)):
                self.tracker.rows_readers[name] = self.tracker.rows[id(args[0])]
            sources = self.tracker.sources(args[0])
            owner = label.format(type(module).__name__)
            if is_linear(module) and name in self.forced:
                self.styles[name] = "replicate"
                if sources:
                    self.tracker.violations.append((sources, f"{owner} reads its split activations"))
            elif is_linear(module) and name.startswith(self.block_prefixes):
                self.styles[name] = "rowwise" if sources else "colwise"
                if not sources:
                    record_linear_input(args[0], self.tracker.made, self.tracker.int_uses)
                self.tracker.widths[name] = out_features(module)
                self.legit[owner] = True
                if sources:
                    self.closer_inputs[name] = self.closer_inputs.get(name, frozenset()) | sources
            elif sources and self._weightless_norm(module, args[0], sources):
                self.styles[name] = "sharded_norm"  # a parameter-free norm across the split width (Dory's L2 norm)
                self.legit[owner] = True
                self.tracker.inside.append(name)
            elif sources and any(True for _ in module.parameters(recurse=False)):
                width = args[0].shape[-1]
                params = list(module.parameters(recurse=False))
                if all(p.dim() == 1 and p.numel() == width for p in params) and width in self.widths_of_heads:
                    self.styles[name] = "replicate_grad_allreduce"  # per head (Qwen3's q_norm/k_norm)
                    self.legit[owner] = True
                    self.tracker.inside.append(name)
                elif within_heads(self.tracker, args[0], params):
                    # the same parameters for every head, acting on each head's own features (Inkling's bank of
                    # relative-logit profiles): replicated, gradients summed over TP; its ops still checked
                    self.styles[name] = "replicate_grad_allreduce"
                    self.legit[owner] = True
                elif (
                    all(p.numel() == width for p in params)
                    and rms_norm_eps(module) is not None
                    and (len(args) < 2 or gates_before_norm(module))  # Mamba-2's gated norm, one group
                ):
                    self.styles[name] = "sharded_norm"  # across the whole split width (OLMo-2's q_norm)
                    self.legit[owner] = True
                    self.tracker.inside.append(name)
                else:
                    across = all(p.numel() == width for p in params)
                    why = (sources, f"{owner} {'normalizes across' if across else 'acts on'} the split width {width}")
                    if (
                        (across and len(params) == 1)
                        or heads_shaped(self.tracker, args[0], params)
                        or per_channel_module(module, params, self.tracker.heads)
                        or channels_inside(params, width)
                    ):
                        # perhaps a norm over groups that the split keeps whole (Mamba-2's gated norm at
                        # n_groups divisible by tp), parameters per head and channel (Inkling 2's L2 clip's
                        # scale), a convolution per channel or per head, a scale per head (Zaya's CCA conv
                        # and key temperature), taps per channel stored [kernel, channels] (Inkling 2's dynamic
                        # conv): its ops decide (``ShardTracker.deferred``)
                        self.tracker.deferred.append((name, why, len(self.tracker.violations)))
                    else:
                        self.tracker.violations.append(why)

        return hook

    def _weightless_norm(self, module: nn.Module, x: torch.Tensor, sources: frozenset[str]) -> bool:
        """Whether ``module`` is a parameter-free norm (``hf.weightless_norm``) over the whole width of a
        column-parallel output (not one head's: Dory's per-head q_norm reduces within each rank's heads; nor
        one split along an earlier dim, its heads, whatever its last dim's size: Inkling 2's value heads)."""
        return (
            x.dim() > 0
            and split_last(self.tracker.layouts, x)
            and x.shape[-1] in {self.tracker.widths.get(s) for s in sources}
            and bool(weightless_norm(module))
        )

    def inputs(self, name: str):
        def hook(module, args, kwargs):
            record_inputs(self.tracker, name, args, kwargs, module)  # per-head tensors it is handed (ALiBi)

        return hook

    def post(self, name: str):
        def hook(module, args, out):
            if self.running and self.running[-1] == name:
                self.running.pop()
            if self.tracker.inside and self.tracker.inside[-1] == name:
                self.tracker.inside.pop()
            if self.tracker.deferred and self.tracker.deferred[-1][0] == name:
                _, why, start = self.tracker.deferred.pop()
                if len(self.tracker.violations) > start or any(
                    id(p) not in self.tracker.follows for p in _unplaced(module, name, self.styles)
                ):
                    self.tracker.violations.insert(start, why)
            self.tracker.returned |= {id(t) for t in tree_flatten(out)[0] if isinstance(t, nn.Parameter)}
            if isinstance(out, torch.Tensor) and self.styles.get(name) in ("colwise", "rowwise", "replicate"):
                self.tracker.mark(out, frozenset({name}) if self.styles[name] == "colwise" else None)
                if self.styles[name] == "colwise":
                    self.tracker.layouts[id(out)] = (-1, (out.shape[-1],))
                    self.tracker.cuts.origins[id(out)] = (name, 0)
                    self.tracker.projections.add(id(out))  # what an adapter is added to (``summed.track``)
                self.outputs[name] = out
            narrowed = name in self.tracker.narrowed and self.styles.get(name) == "rowwise"
            if narrowed and isinstance(out, torch.Tensor):
                mark(self.tracker, name, out)  # one value per head, each rank its heads' (Doge's dt_proj)
            elif self.styles.get(name) == "rowwise":
                record(self.tracker, name, out)
            track_output(self.tracker, name, out, self.styles.get(name) == "rowwise" and not narrowed)
            if name in self.latents and isinstance(out, torch.Tensor):
                self.tracker.latent[id(out)] = frozenset({name})
            for t in tree_flatten(out)[0]:
                # one with no gradient carries no partial one out (GLM-DSA's attention returns its indexer's top-k),
                # nor does a split reader's output (Zamba2's adapter returns its up-projection's: whole gradients)
                carries = isinstance(t, torch.Tensor) and t.requires_grad and not self.tracker.is_sharded(t)
                for fqn in self.tracker.latent.get(id(t), ()) if carries else ():
                    if not name.startswith(f"{fqn.rpartition('.')[0]}."):  # it leaves the module holding it
                        self.tracker.latent_leaks.setdefault(fqn, f"{name} returns it")

        return hook


def within_heads(tracker: ShardTracker, t: torch.Tensor, params: list[nn.Parameter]) -> bool:
    """Whether parameters of a module reading split activations ``t`` act within each head: ``t`` split
    along a dim before its last (its heads), every parameter at least 2-D with its first dim the last
    one's size (one head's features: Inkling's ``relative_states @ proj``, ``proj`` [d_rel, extent]). The
    1-D case is a per-head norm's, judged by its widths; a parameter spanning the heads is no such case."""
    layout = tracker.layouts.get(id(t))
    if layout is None or t.dim() < 3 or layout[0] % t.dim() == t.dim() - 1:
        return False
    return all(p.dim() >= 2 and p.shape[0] == t.shape[-1] for p in params)


def heads_shaped(tracker: ShardTracker, t: torch.Tensor, params: list[nn.Parameter]) -> bool:
    """Whether every parameter has the shape of ``t``'s dims from its split dim on, at least 2-D (Inkling 2's
    scale [heads, head_dim] multiplying [..., heads, head_dim]): per head and channel, it may follow the heads."""
    layout = tracker.layouts.get(id(t))
    if layout is None or not t.dim():
        return False
    split = layout[0] % t.dim()
    return bool(params) and all(p.dim() >= 2 and tuple(p.shape) == tuple(t.shape[split:]) for p in params)


def per_channel_module(module: nn.Module, params: list[nn.Parameter], heads: set[int]) -> bool:
    """Whether ``module`` may act per channel or per head on split activations, so its ops (``follow.py``)
    decide: a convolution (depthwise, or grouped per head: Zaya's ``conv_qk_depthwise``, ``conv_qk_grouped``
    called as modules), or 1-D parameters of a head count (Zaya's per-kv-head key temperature)."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return True
    return bool(params) and all(p.dim() == 1 and p.numel() in heads for p in params)


def channels_inside(params: list[nn.Parameter], width: int) -> bool:
    """Whether every parameter has the split width as a later dim, not its first (Inkling 2's dynamic
    conv's static taps [kernel, channels]): per channel, transposed, so its ops decide (``follow.py``)."""
    return bool(params) and all(p.dim() >= 2 and width in p.shape[1:] for p in params)


def _unplaced(module: nn.Module, name: str, styles: dict[str, str]) -> list[nn.Parameter]:
    """The parameters of ``module`` and of its children not placed by a style of their own (Inkling 2's dynamic
    conv's ``weight_proj``, a column-parallel linear): those a deferred module's ops must have seen follow."""
    placed = {id(p) for child, m in module.named_modules(prefix=name) if child in styles for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in placed]
