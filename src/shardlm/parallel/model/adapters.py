"""What peft puts on a model: its LoRA layers (``is_lora_layer``), the adapter name shardlm trains,
the HF checkpoint key of a model key (``hf_key``: ``base_layer`` and ``original_module`` unwrapped,
adapters none) and the key peft saves a trainable parameter under (``peft_key``).
"""

from __future__ import annotations

import torch.nn as nn

ADAPTER = "default"  # peft's adapter name; the only one shardlm trains


PEFT_PREFIX = "base_model.model."


def is_adapter_key(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def hf_key(name: str) -> str | None:
    """The HF checkpoint key of a model key; None for adapters (no HF file holds them) and for
    ``modules_to_save`` copies (filled from their original, ``copy_modules_to_save``)."""
    if is_adapter_key(name) or f".modules_to_save.{ADAPTER}." in name:
        return None
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def peft_key(name: str) -> str:
    """The key peft's ``save_pretrained`` gives a trainable parameter of the injected model."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.{ADAPTER}.", f".{part}.")
    return PEFT_PREFIX + name.replace(f".modules_to_save.{ADAPTER}.", ".")


def is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)
