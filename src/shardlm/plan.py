"""Tensor-parallel plan: which style each module of a Hugging Face causal LM gets.

A plan is ``{module_fqn: style}`` with styles from a small vocabulary (see ``styles.py``):

* ``colwise``  - Linear sharded by output features (reads the replicated block input)
* ``rowwise``  - Linear sharded by input features (its output is all-reduced into the residual)
* ``embedding`` - token embedding sharded by vocabulary rows (vocab-parallel)
* ``lm_head``  - output projection sharded by vocabulary; logits stay sharded for the loss
* ``replicate`` - every other module that owns parameters (norms): replicated DTensors on the
  TP mesh, so every parameter of the model lives on one mesh

The decoder-block projections come from the model config's ``base_model_tp_plan`` (Llama,
Mistral, Qwen2 and any family whose plan is plain colwise/rowwise entries); embedding and head
are found through ``get_input_embeddings`` / ``get_output_embeddings``, not by name.
"""

from __future__ import annotations

import fnmatch
import re

import torch.nn as nn

from shardlm.errors import ConfigError

STYLES = ("colwise", "rowwise", "embedding", "lm_head", "replicate")


def _module_name(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise ValueError("module not found in model")


def _hf_block_plan(model: nn.Module) -> dict[str, str]:
    """Expand the config's ``base_model_tp_plan`` patterns (``layers.*.mlp.up_proj``) to FQNs."""
    raw = getattr(model.config, "base_model_tp_plan", None) or {}
    unsupported = {k: v for k, v in raw.items() if v not in ("colwise", "rowwise")}
    if not raw or unsupported:
        what = f"entries {unsupported}" if unsupported else "no base_model_tp_plan"
        raise ConfigError(
            f"parallel.tp: {type(model).__name__} has {what}; only plain colwise/rowwise plans "
            "(Llama, Mistral, Qwen2, ...) are supported so far; use parallel.tp=1"
        )
    prefix = getattr(model, "base_model_prefix", "model")
    patterns = [(re.compile(fnmatch.translate(f"{prefix}.{k}")), v) for k, v in raw.items()]
    plan = {}
    for name, module in model.named_modules():
        for regex, style in patterns:
            if isinstance(module, nn.Linear) and regex.match(name):
                plan[name] = style
    return plan


def infer_tp_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """The plan for ``model`` at TP degree ``tp`` (works on a meta-device model)."""
    if tp == 1:
        return {}
    check_config_geometry(model.config, tp)
    plan = _hf_block_plan(model)
    plan[_module_name(model, model.get_input_embeddings())] = "embedding"
    plan[_module_name(model, model.get_output_embeddings())] = "lm_head"
    styled = set(plan)
    for name, module in model.named_modules():
        owns_params = any(True for _ in module.parameters(recurse=False))
        if owns_params and name not in styled:
            plan[name] = "replicate"
    return plan


def _valid_tps(*sizes: int) -> list[int]:
    limit = min(sizes)
    return [t for t in range(1, limit + 1) if all(s % t == 0 for s in sizes)]


def check_config_geometry(config, tp: int) -> None:
    """Refuse a TP degree the model's shapes cannot be split by, naming the numbers."""
    if tp == 1:
        return
    checks = {
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    present = {k: v for k, v in checks.items() if isinstance(v, int)}
    for key, size in present.items():
        if size % tp:
            valid = _valid_tps(*present.values())
            raise ConfigError(
                f"parallel.tp={tp} does not divide the model's {key}={size}; "
                f"valid tp values for this model: {', '.join(map(str, valid))}"
            )


def check_geometry(model_path: str, tp: int) -> None:
    """Read ``config.json`` of ``model_path`` and check it against ``tp`` (before spawning)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise ConfigError(f"model: cannot read '{model_path}/config.json': {str(exc).splitlines()[0]}") from None
    check_config_geometry(config, tp)
