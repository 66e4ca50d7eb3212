"""What shardlm reads off a Hugging Face model, in one place: config names, Conv1D, tied weights,
the fused kernels a mixer may call.

Families name the same size differently (``num_attention_heads`` / ``n_head`` / ``num_heads``),
some configs refuse to answer a global value (Gemma 4's per-layer ``head_dim``), GPT-2-style
``Conv1D`` stores its weight transposed (``[in, out]``), and tied input/output embeddings are one
parameter under two names. The plan, the styles, LoRA, the estimator and the checkpoint code
all ask here, so they cannot disagree.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn as nn

# the config attribute names of each size, in the order they are tried
CONFIG_NAMES = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "vocab_size": ("vocab_size",),
    # a Mamba-2 mixer's B/C groups and scan chunk (``estimate/scans.py``: what its parameters do not tell)
    "ssm_groups": ("n_groups", "mamba_n_groups"),
    "ssm_chunk": ("chunk_size", "mamba_chunk_size"),
}
# the sizes tensor parallelism must divide (``autotp.check_config_geometry``); not ``vocab_size``, split in
# torch's chunks, the last rank's shorter where tp does not divide it (``autotp.holds_vocab_rows``)
SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
# attribute names attention modules keep their head counts under (localized per rank by ``plan/local_geometry.py``)
MODULE_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_attn_heads")
MODULE_KV_ATTRS = ("num_key_value_heads", "num_kv_heads")
MODULE_KV_COUNT_ATTRS = MODULE_KV_ATTRS + ("num_key_value_groups",)
# fused kernels that read the weights of a mixer's projections themselves (the GPU fast path of
# transformers' Mamba and Mamba-2 mixers, from mamba_ssm or the hub's kernels): they bypass the split
# of those layers (``x_proj`` row-parallel, ``out_proj``'s all-reduce), so such a mixer cannot be
# split where they run (``autotp.check_fused_kernels``)
WEIGHT_KERNELS = ("mamba_inner_fn", "split_conv1d_scan_combined")


def language_config(config):
    """The config of the language model: a multimodal checkpoint's text config (Gemma 3's
    ``Gemma3ForConditionalGeneration`` holds its sizes in ``text_config``; transformers'
    ``get_text_config`` says which), else the config itself. Every size shardlm splits by is the
    language model's: the vision or audio tower is kept whole."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def config_value(config, name: str):
    """``name`` of the language model's config (``language_config``), or None where the config has
    no single value (Gemma 4's per-layer ``head_dim`` raises rather than answer)."""
    try:
        return getattr(language_config(config), name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and the like
        return None


def tower_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters outside the language model: a multimodal checkpoint's vision or audio
    tower and its projector (Gemma 3's ``model.vision_tower``, ``model.multi_modal_projector``);
    empty for a text model. The language model is what transformers' ``get_decoder`` returns, with
    the input and output embeddings. The plan keeps the towers whole (no text row reaches them).
    Only a multimodal config (its text config a sub-config) has towers: a text model's parameters
    outside ``get_decoder`` are its own head's (RoCBert's ``cls.predictions.transform``) and train."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config") or config.get_text_config() is config:
        return []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        return []
    keep = {id(p) for p in decoder.parameters()}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        keep |= {id(p) for p in module.parameters()} if module is not None else set()
    return [name for name, p in model.named_parameters() if id(p) not in keep]


def config_size(config, key: str) -> int | None:
    """The size ``key`` of ``CONFIG_NAMES`` under the first name this family uses (a positive int);
    one kv head for multi-query attention (``multi_query``)."""
    if key == "num_key_value_heads" and multi_query(config):
        return 1
    for name in CONFIG_NAMES[key]:
        value = config_value(config, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def multi_query(config) -> bool:
    """Multi-query attention (GPT-BigCode, Falcon before its new decoder architecture): one key/value
    head whatever ``num_kv_heads`` says, packed after the query heads in the fused projection."""
    return config_value(config, "multi_query") is True and not config_value(config, "new_decoder_architecture")


def geometry(config) -> dict[str, int]:
    """The sizes TP must divide that this config has (``SPLIT_SIZES``)."""
    return {key: v for key in SPLIT_SIZES if (v := config_size(config, key)) is not None}


def per_layer_values(config, name: str) -> set[int]:
    """Values of ``name`` in a per-layer config (Gemma 4's ``per_layer_config``), if any. BLT's top-level
    config holds an empty one whose length reads a ``num_hidden_layers`` only its sub-configs have: none."""
    found = set()
    per_layer = config_value(config, "per_layer_config")
    try:
        layers = list(per_layer.values() if isinstance(per_layer, dict) else per_layer or [])
    except AttributeError:
        layers = []
    for layer in layers:
        value = layer.get(name) if isinstance(layer, dict) else getattr(layer, name, None)
        if isinstance(value, int):
            found.add(value)
    return found


def head_widths(config) -> set[int]:
    """Head dims of the attention layers (several where layers differ, as in Gemma 4)."""
    heads, hidden = config_size(config, "num_attention_heads"), config_size(config, "hidden_size")
    widths = {w for w in [config_value(config, "head_dim")] if isinstance(w, int)} | per_layer_values(
        config, "head_dim"
    )
    if not widths and heads and hidden:
        widths.add(hidden // heads)
    return widths


def all_head_widths(config) -> set[int]:
    """``head_widths`` and the other head dims a config names (``..._head_dim``: Qwen3.5's Gated
    DeltaNet ``linear_key_head_dim``/``linear_value_head_dim``, MLA's ``v_head_dim``): widths a
    per-head norm or a mixer's size may have, never split."""
    widths = head_widths(config)
    for name in dir(config):
        if name.endswith("head_dim") and name != "head_dim" and not name.startswith("_"):
            value = config_value(config, name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                widths.add(value)
    return widths


def head_counts(config) -> set[int]:
    """Head counts (query and kv), per-layer ones included, and those a config names for one stack of
    several (ProphetNet's ``num_decoder_attention_heads``, its ``num_attention_heads`` the encoder's):
    dims of per-head tensors."""
    geo = geometry(config)
    counts = {geo[k] for k in ("num_attention_heads", "num_key_value_heads") if k in geo}
    for name in dir(config):
        if name.endswith("_attention_heads") and not name.startswith("_"):
            value = config_value(config, name)
            counts |= {value} if isinstance(value, int) and not isinstance(value, bool) and value > 0 else set()
    return counts | per_layer_values(config, "num_attention_heads") | per_layer_values(config, "num_key_value_heads")


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and relatives): a linear layer whose weight is ``[in, out]``."""
    return type(module).__name__ == "Conv1D"


def is_depthwise_conv(module: nn.Module) -> bool:
    """A short convolution along the sequence, one filter per channel (linear attention's and
    Mamba's mixers): what carries state from one token to the next outside attention. Read off one input
    channel per filter, not ``groups == in_channels``: after TP a rank's conv runs its own channels' groups
    (``infer/channels._local_groups``) while ``in_channels`` keeps the whole width."""
    return (
        isinstance(module, nn.Conv1d)
        and module.in_channels == module.out_channels
        and module.groups > 1
        and module.weight.shape[1] == 1
    )


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def looks_up_rows(module: nn.Module) -> bool:
    """A plain ``nn.Embedding``: its lookup reads and its gradient touches only the rows its ids name
    (no ``max_norm`` renormalizing them, no ``scale_grad_by_freq`` / ``sparse`` gradient), so a rank
    holding a run of the vocabulary can look up its ids on its own rows (``runtime/embedding.py``)."""
    if not isinstance(module, nn.Embedding) or module.max_norm is not None:
        return False
    return not module.scale_grad_by_freq and not module.sparse


def lookup_norm(module: nn.Module) -> str | None:
    """The child a normed embedding applies to its lookup (Inkling's ``embed_norm(super().forward(ids))``):
    an ``nn.Embedding`` subclass with a forward of its own and exactly one parameterized submodule, a
    direct child, read by the vocabulary-parallel style (``runtime/embedding.py``) as the place where
    the rows are whole. None for a plain embedding or any other shape."""
    if not isinstance(module, nn.Embedding) or type(module).forward is nn.Embedding.forward:
        return None
    owners = {n for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))}
    return next(iter(owners)) if len(owners) == 1 and "." not in next(iter(owners)) else None


def extra_params(module: nn.Module) -> list[str]:
    """The names of ``module``'s own parameters other than ``weight`` and ``bias`` (an LM head's per-token
    ``logit_scale``: Dory's; ``infer/vocab_head.py`` checks them, ``runtime/linear.Colwise`` places them)."""
    return [n for n, _ in module.named_parameters(recurse=False) if n not in ("weight", "bias")]


def out_dim(module: nn.Module) -> int:
    """The weight dimension that holds the output features (1 for Conv1D, 0 for nn.Linear)."""
    return 1 if is_conv1d(module) else 0


def out_features(module: nn.Module) -> int:
    return module.weight.shape[out_dim(module)]


def tied_keys(model: nn.Module) -> set[str]:
    """Parameter names that name a parameter already named by an earlier one (tied embeddings)."""
    seen: dict[int, str] = {}
    tied = set()
    for key, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(key)
        seen.setdefault(id(param), key)
    return tied


def rms_norm_eps(module: nn.Module) -> float | None:
    """The epsilon of ``module`` if it computes ``weight * x / sqrt(mean(x^2) + eps)`` (in fp32),
    checked by running a CPU copy of it on random numbers; None otherwise (LayerNorm, Gemma's
    ``1 + weight``, anything else) so that only what ``sharded_norm`` reproduces gets it."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if [n for n, _ in module.named_parameters(recurse=False)] != ["weight"] or not isinstance(eps, float):
        return None
    return eps if _computes_rms_norm(module, eps, gated=False) else None


def gates_before_norm(module: nn.Module) -> bool:
    """Whether ``module(x, gate)`` computes ``weight * h / sqrt(mean(h^2) + eps)`` of ``h = x * silu(gate)``
    (Mamba-2's gated RMSNorm with one group, ``norm_before_gate=False``), checked like ``rms_norm_eps``."""
    eps = rms_norm_eps(module)
    return eps is not None and _computes_rms_norm(module, eps, gated=True)


def _computes_rms_norm(module: nn.Module, eps: float, gated: bool) -> bool:
    """Run a CPU copy of ``module`` on random numbers, ``probe(x)`` (or ``probe(x, gate)``), against
    the RMSNorm of ``x`` (or of ``x * silu(gate)``); a forward taking other arguments does not match."""
    probe = copy.deepcopy(module).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=g))
        x, gate = (torch.randn(3, probe.weight.shape[0], generator=g) for _ in range(2))
        h = x * torch.nn.functional.silu(gate) if gated else x
        want = probe.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        try:
            got = probe(x, gate) if gated else probe(x)
        except TypeError:  # a forward of other arguments (a gated norm's gate when ungated): not this norm
            return False
        return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6))


def weightless_norm(module: nn.Module) -> tuple[float, bool] | None:
    """``(eps, mean)`` if ``module`` owns no parameters or buffers and computes ``x / sqrt(sum(x^2) + eps)``
    (nGPT's L2 norm onto the unit sphere, Dory's ``DoryL2Norm``; ``mean`` False) or ``x / sqrt(mean(x^2) + eps)`` (a
    weightless RMSNorm; ``mean`` True) over its input's last dim, in fp32; None otherwise. Checked by
    running it on random numbers, so that only what ``sharded_norm`` reproduces gets that style."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()) or not isinstance(eps, float):
        return None
    # outside every torch-function mode (a trace's tracker, the meta device) and the module's own hooks
    with torch._C.DisableTorchFunction(), torch.no_grad():
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0), device="cpu")
        try:
            got = type(module).forward(module, x)
        except Exception:  # noqa: BLE001 - a forward of other arguments: not this norm
            return None
        for mean in (False, True):
            want = x * torch.rsqrt(_squares(x, mean) + eps)
            if isinstance(got, torch.Tensor) and got.shape == x.shape and torch.allclose(got, want, 1e-5, 1e-6):
                return eps, mean
    return None


def _squares(x: torch.Tensor, mean: bool) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True) if mean else x.pow(2).sum(-1, keepdim=True)


def weight_kernels_available() -> bool:
    """Whether transformers would run ``WEIGHT_KERNELS`` here: mamba_ssm on a CUDA machine, or the
    hub's kernels switched on (``TRANSFORMERS_USE_HUB_KERNELS``)."""
    from transformers.integrations import hub_kernels
    from transformers.utils.import_utils import is_mamba_ssm_available

    return is_mamba_ssm_available() or bool(getattr(hub_kernels, "_kernels_enabled", False))


def weight_kernel(module: nn.Module) -> str | None:
    """The fused kernel of ``WEIGHT_KERNELS`` the forward of ``module``'s class may call, or None."""
    try:
        source = inspect.getsource(type(module))
    except (OSError, TypeError):  # a class without source (built in a test, or compiled)
        return None
    return next((k for k in WEIGHT_KERNELS if k in source), None)
