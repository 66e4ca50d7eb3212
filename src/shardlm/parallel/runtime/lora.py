"""LoRA under tensor parallelism and FSDP2: peft's layers and file format, shardlm's placements.

peft (``inject_adapter_in_model``) wraps each targeted projection ``X`` in a ``lora.Linear``
holding ``X.base_layer`` and the adapter ``X.lora_A.default`` ([r, in]) / ``X.lora_B.default``
([out, r]); its forward (``base(x) + B(A(dropout(x))) * scaling``) is used unchanged. shardlm
only places the pieces, from the style the plan gave ``X`` (``LoraParallel``):

* ``colwise`` / ``packed_colwise`` base: ``lora_A`` replicated, ``lora_B`` sharded by output
  rows exactly like the base weight (each part on its own for packed projections, so every rank
  holds the adapter rows of its own heads). The input enters once as a replicated activation
  whose gradient is summed over TP in the backward (shared with the base and sibling layers).
  ``lora_A``'s gradient from one rank covers only that rank's output rows: it is summed over TP.
* ``rowwise`` base: ``lora_A`` sharded by input columns like the base weight, ``lora_B``
  replicated. Base and adapter outputs are both partial sums; they are added *before* the one
  all-reduce of the layer, and the bias after it. ``lora_B`` reads a partial activation, so its
  gradient is summed over TP.

All matmuls run on local tensors (the DTensor parameters' ``to_local()``), so the only
collectives are the layer's own reduction and, once per step, the sum of the replicated
adapters' gradients (``ParallelModel.tp_partial_grads``, shared with ``replicate_grad_allreduce``).
FSDP2 then shards whatever is left, as for any parameter.

Only adapter and ``modules_to_save`` parameters require grad; the optimizer, the gradient
norm and checkpoints see only them. Under ``train.bf16`` the frozen base is stored in bf16.

Initial adapters are peft's default (``lora_A`` Kaiming-uniform, ``lora_B`` zero) drawn from a
generator seeded with ``train.seed``, so every rank computes the same full tensors and keeps its
piece without communication; ``lora.adapter`` instead reads a peft adapter directory.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from shardlm.config import LoraConfig
from shardlm.distributed.shards import RowsShard, as_local, fill_from_full, local_view, packed_placement
from shardlm.errors import ConfigError
from shardlm.parallel.model.adapters import ADAPTER, is_lora_layer, peft_key
from shardlm.parallel.model.hf import is_conv1d
from shardlm.parallel.plan.plan import Plan
from shardlm.parallel.plan.styles import SPLIT_LINEAR, Style, lora_dims, sharded_dim
from shardlm.parallel.runtime.linear import column_input, local_linear, shard_params, sliced_linear
from shardlm.parallel.runtime.plan_styles import make_style, plan_styles
from shardlm.parallel.runtime.regions import reduce_from_region, reduce_scatter_to_sequence_region

CONFIG_FILE = "adapter_config.json"


WEIGHTS_FILE = "adapter_model.safetensors"


def _adapter_config(path: str):
    from peft import LoraConfig as PeftLoraConfig

    if not os.path.isfile(os.path.join(path, CONFIG_FILE)) or not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ConfigError(f"lora.adapter: '{path}' is not a peft adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
    try:
        with open(os.path.join(path, CONFIG_FILE)) as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"lora.adapter: '{path}/{CONFIG_FILE}' cannot be read ({exc})") from None
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else None
        raise ConfigError(f"lora.adapter: '{path}' holds a {kind} adapter; only LORA adapters train")
    # target_parameters: peft's LoRA on fused parameters (the routed experts' [E, out, in]), not placed
    for flag in ("use_dora", "lora_bias", "use_qalora", "target_parameters"):
        if raw.get(flag):
            raise ConfigError(f"lora.adapter: '{path}' uses {flag}, which shardlm does not place; use a plain LoRA")
    if raw.get("bias", "none") != "none":
        raise ConfigError(f"lora.adapter: '{path}' trains biases (bias={raw['bias']!r}); only bias='none' is placed")
    return PeftLoraConfig.from_pretrained(path)


def peft_config(lcfg: LoraConfig, model: nn.Module):
    """The ``peft.LoraConfig`` of the run: from ``lora.adapter``'s directory, or from the section."""
    from peft import LoraConfig as PeftLoraConfig

    if lcfg.adapter:
        cfg = _adapter_config(lcfg.adapter)
        mine = {
            "r": lcfg.r,
            "alpha": lcfg.alpha,
            "target_modules": lcfg.target_modules,
            "modules_to_save": lcfg.modules_to_save,
        }
        theirs = {
            "r": cfg.r,
            "alpha": cfg.lora_alpha,
            "target_modules": cfg.target_modules,
            "modules_to_save": cfg.modules_to_save,
        }
        for key, value in mine.items():
            same = value is None or (
                sorted(value) == sorted(theirs[key] or [])
                if key in ("target_modules", "modules_to_save") and not isinstance(value, str)
                else value == theirs[key]
            )
            if not same:
                raise ConfigError(
                    f"lora.{key}: {value!r} differs from the adapter's {theirs[key]!r} in '{lcfg.adapter}'; "
                    f"remove lora.{key} (the adapter sets it)"
                )
        cfg.lora_dropout = lcfg.dropout
        cfg.inference_mode = False
        return cfg
    r = lcfg.r or 8
    return PeftLoraConfig(
        r=r,
        lora_alpha=lcfg.alpha if lcfg.alpha is not None else 2 * r,
        lora_dropout=lcfg.dropout,
        target_modules=lcfg.target_modules,
        modules_to_save=lcfg.modules_to_save,
        fan_in_fan_out=any(is_conv1d(m) for m in model.modules()),  # GPT-2's Conv1D: weight is [in, out]
    )


def inject(model: nn.Module, lcfg: LoraConfig):
    """Wrap the targets of ``lcfg`` in peft LoRA layers (in place, on the meta model); freeze the rest."""
    import warnings

    from peft import inject_adapter_in_model

    cfg = peft_config(lcfg, model)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            inject_adapter_in_model(cfg, model, adapter_name=ADAPTER)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        first = str(exc).strip().splitlines()[0]
        if first.startswith("Target module ") and "(" in first:  # "Target module Cls(<repr>... is not supported"
            kind = first.removeprefix("Target module ").split("(")[0]
            fqn = next((n for n, m in model.named_modules() if type(m).__name__ == kind), kind)
            first = (
                f"'{fqn}' is a {kind}, which peft cannot adapt (it adapts linear, embedding and convolution "
                "layers; a mixture-of-experts layer's routed experts are fused parameters); remove it"
            )
        raise ConfigError(f"lora.target_modules: {first}") from None
    return cfg


def check_lora(lcfg: LoraConfig, model: nn.Module, plan: Plan) -> None:
    """Before spawning: values, the adapter directory, and that every target of ``model`` (a meta
    model, adapted in place) has a placement in ``plan``."""
    if lcfg.r is not None and lcfg.r < 1:
        raise ConfigError(f"lora.r must be >= 1, got {lcfg.r}")
    if not 0.0 <= lcfg.dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lcfg.dropout}")
    if lcfg.adapter and not os.path.isdir(lcfg.adapter):
        raise ConfigError(f"lora.adapter: '{lcfg.adapter}' is not a directory; pass a peft adapter directory")
    inject(model, lcfg)
    from peft.tuners.lora import Linear as PeftLinear

    for name, module in model.named_modules():
        if is_lora_layer(module) and not isinstance(module, PeftLinear):
            raise ConfigError(
                f"lora.target_modules: '{name}' is not a linear layer ({type(module.get_base_layer()).__name__}); "
                "shardlm trains LoRA on linear projections only, remove it (or list it in lora.modules_to_save)"
            )
    lora_styles(model, plan)  # raises for a target the plan gives no LoRA placement


def _is_modules_to_save(module: nn.Module) -> bool:
    from peft.utils import ModulesToSaveWrapper

    return isinstance(module, ModulesToSaveWrapper)


class LoraParallel(ParallelStyle):
    """A peft ``lora.Linear`` whose base layer has the plan style ``base_style`` (module docstring).

    ``parts``: a packed base's part sizes (its output rows, and ``lora_B``'s, split part by part).
    ``rows``: the plan's ``sliced`` entry (k/v with fewer kv heads than tp, fused projections with
    a part every rank needs whole): base and ``lora_B`` stay replicated and each rank computes only
    its rows, as ``linear.SlicedColwise`` does; both adapter matrices then get their gradients summed
    over TP. ``scattered``: a row-parallel base under sequence parallelism, whose partial sum is
    reduce-scattered to the sequence slices (``plan.sequence.scattered_rows``). ``stored_rows``: the plan's
    ``stored_rows`` entry of a colwise base (Zaya's value projections): base and ``lora_B`` held by those
    rows (``shards.RowsShard``), computed as any colwise base.
    """

    def __init__(
        self,
        base_style: str,
        parts: list[int] | None = None,
        rows: list | None = None,
        scattered: bool = False,
        stored_rows: list | None = None,
    ):
        super().__init__()
        self.base_style, self.parts, self.rows, self.scattered = base_style, parts, rows, scattered
        self.stored_rows = stored_rows

    def _split(self, module: nn.Module, param: str | None = None, dim: int | None = None):
        """The TP placement of ``module.<param>`` under the base style (or of dim ``dim``): a packed
        projection's parts are each split on their own (``shards.packed_placement``)."""
        dim = sharded_dim(self.base_style, module, param) if dim is None else dim
        if dim is None:
            return Replicate()
        if self.stored_rows is not None:
            return RowsShard(dim, self.stored_rows)
        packed = self.base_style == Style.PACKED_COLWISE
        return packed_placement(dim, self.parts) if packed else Shard(dim)

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        base, lora_a, lora_b = module.base_layer, module.lora_A[ADAPTER], module.lora_B[ADAPTER]
        if self.rows is not None:
            rows = self.rows[mesh.get_local_rank()]
            for layer in (base, lora_a, lora_b):
                shard_params(layer, mesh, {"weight": Replicate(), "bias": Replicate()}, None)
            base.forward = lambda x: sliced_linear(base, x, rows)
            lora_b.forward = lambda x: sliced_linear(lora_b, x, rows)
            lora_a.forward = lambda x: local_linear(lora_a, x)
            module.register_forward_pre_hook(lambda mod, args: (column_input(args[0], mesh), *args[1:]))
            return module
        a_dim, b_dim = lora_dims(self.base_style)
        shard_params(base, mesh, {"weight": self._split(base, "weight"), "bias": self._split(base, "bias")}, None)
        shard_params(lora_a, mesh, {"weight": self._split(lora_a, dim=a_dim)}, None)
        shard_params(lora_b, mesh, {"weight": self._split(lora_b, dim=b_dim)}, None)
        if a_dim is not None:  # the base reads a sharded input: partial sums, reduced with the adapter's
            base.forward = lambda x: local_linear(base, x, with_bias=False)
            module.register_forward_hook(lambda mod, args, out: _reduce_add_bias(out, base.bias, mesh, self.scattered))
        else:  # the base reads a replicated input and writes its own output rows
            base.forward = lambda x: local_linear(base, x)
            module.register_forward_pre_hook(lambda mod, args: (column_input(args[0], mesh), *args[1:]))
        lora_a.forward = lambda x: local_linear(lora_a, x)
        lora_b.forward = lambda x: local_linear(lora_b, x)
        return module


def _reduce_add_bias(
    out: torch.Tensor, bias: torch.Tensor | None, mesh: DeviceMesh, scattered: bool = False
) -> torch.Tensor:
    """All-reduce the partial sum (base + adapter) of a row-parallel layer (backward: identity), or
    reduce-scatter it to the sequence slices (``scattered``; backward: all-gather), then add the
    replicated bias once."""
    if scattered:
        out = reduce_scatter_to_sequence_region(out, mesh)
    else:
        out = reduce_from_region(out, mesh)
    return out + local_view(bias) if bias is not None else out


def lora_styles(model: nn.Module, plan: Plan, scattered: set[str] | frozenset = frozenset()) -> dict:
    """The TP styles of a LoRA-injected model: ``LoraParallel`` for adapted projections; a
    ``modules_to_save`` module's style moves to its frozen original and its trained copy;
    ``scattered``: ``plan_styles``'s."""
    styles = plan_styles(plan, scattered)
    for fqn, style in plan.styles.items():
        module = model.get_submodule(fqn)
        if is_lora_layer(module) and fqn in plan.latent_readers:
            raise ConfigError(
                f"lora.target_modules: '{fqn}' reads the low-rank latent of {plan.latent_readers[fqn]} under tensor "
                "parallelism (multi-head latent attention), which LoRA cannot adapt there yet; remove it from "
                "target_modules or use parallel.fsdp instead of tp"
            )
        if is_lora_layer(module) and fqn in plan.summed:
            raise ConfigError(
                f"lora.target_modules: '{fqn}' is a row-parallel layer whose output is read back inside the split "
                "channels (Mamba's x_proj), which LoRA cannot adapt there under tensor parallelism yet; remove it "
                "from target_modules or use parallel.fsdp instead of tp"
            )
        if is_lora_layer(module) and fqn in plan.sliced:
            styles[fqn] = LoraParallel(style, rows=plan.sliced[fqn])
        elif is_lora_layer(module):
            if style not in SPLIT_LINEAR:
                raise ConfigError(
                    f"lora.target_modules: '{fqn}' is a {style} layer under tensor parallelism, which LoRA "
                    f"cannot adapt (only {', '.join(SPLIT_LINEAR)} layers); remove it from target_modules"
                )
            stored = plan.stored_rows.get(fqn)
            styles[fqn] = LoraParallel(style, plan.parts.get(fqn), scattered=fqn in scattered, stored_rows=stored)
        elif _is_modules_to_save(module):
            if fqn in plan.sliced or style == Style.REPLICATE_GRAD_ALLREDUCE or _tied(model, module):
                why = "is tied to another module" if _tied(model, module) else f"is a {style} layer computed per rank"
                raise ConfigError(
                    f"lora.modules_to_save: '{fqn}' {why} under tensor parallelism, which shardlm cannot train "
                    "as a separate copy; remove it from modules_to_save or use parallel.fsdp instead of tp"
                )
            del styles[fqn]
            kept = {
                "parts": plan.parts.get(fqn),
                "sequence_parallel": fqn in scattered,
                "stored_rows": plan.stored_rows.get(fqn),
            }
            styles[f"{fqn}.original_module"] = make_style(style, **kept)
            styles[f"{fqn}.modules_to_save.{ADAPTER}"] = make_style(style, **kept)
    return styles


def _tied(model: nn.Module, wrapper: nn.Module) -> bool:
    """Whether a ``modules_to_save`` module's original shares a parameter with another module."""
    mine = {id(p) for p in wrapper.original_module.parameters()}
    return any(id(p) in mine for n, p in model.named_parameters(remove_duplicate=False) if ".original_module." not in n)


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def copy_modules_to_save(model: nn.Module) -> None:
    """The trained copy of each ``modules_to_save`` module starts from the loaded original."""
    for module in model.modules():
        if _is_modules_to_save(module) and ADAPTER in module.modules_to_save:
            copy = dict(module.modules_to_save[ADAPTER].named_parameters())
            for name, param in module.original_module.named_parameters():
                as_local(copy[name]).copy_(as_local(param))


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, whole: list[tuple[str, torch.Size]] | None = None) -> None:
    """peft's default init (``lora_A`` Kaiming-uniform with a=sqrt(5), ``lora_B`` zero) from a
    generator seeded with ``seed``, in module order; each rank keeps its piece of the full tensors.
    ``whole``: the whole model's trainable (name, shape) in order, where ``model`` is one pipeline stage:
    every adapter is drawn in turn and the stage keeps its own, as one process would draw them."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for name, shape in whole or [(name, param.shape) for name, param in params.items()]:
        if f".lora_A.{ADAPTER}." in name:
            full = nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=gen)
            if name in params:
                fill_from_full(params[name], full)
        elif f".lora_B.{ADAPTER}." in name and name in params:
            as_local(params[name]).zero_()


@torch.no_grad()
def load_adapter(model: nn.Module, path: str, whole: list[tuple[str, torch.Size]] | None = None) -> None:
    """Fill every trainable parameter from a peft adapter directory (each rank reads its pieces).
    ``whole``: the whole model's trainable (name, shape), where ``model`` is one pipeline stage: the
    adapter must match the whole model, and the stage reads its own tensors."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as fh:
        saved = set(fh.keys())
        wanted = {peft_key(n): n for n in ([n for n, _ in whole] if whole else trainable_names(model))}
        missing = sorted(set(wanted) - saved)
        if missing:
            raise ConfigError(f"lora.adapter: '{path}' lacks {missing[0]}; it was made for another model or config")
        extra = sorted(saved - set(wanted))
        if extra:
            raise ConfigError(f"lora.adapter: '{path}' has {extra[0]}, which this model's adapter does not")
        params = dict(model.named_parameters())
        for key, name in wanted.items():
            if name not in params:  # another pipeline stage's
                continue
            param = params[name]
            tensor = fh.get_tensor(key)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ConfigError(f"lora.adapter: '{key}' is {list(tensor.shape)}, the model needs {list(param.shape)}")
            fill_from_full(param, tensor)
