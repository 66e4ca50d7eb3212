"""``train.compile``: each decoder block's forward through ``torch.compile`` (inductor).

Per block, as torchtitan does, and the same blocks FSDP2 wraps (``parallel/model/meta.py:
decoder_blocks``): the compiled region is one block, its TP hooks (DTensor in and out) and
transformers' activation checkpointing inside it, FSDP2's all-gather and reduce-scatter hooks on
the block outside it. The block's ``forward`` attribute is replaced rather than the module wrapped
(``torch.compile(module)`` would insert ``_orig_mod`` into every parameter name that plans,
checkpoints and LoRA refer to). Every block shares one compiled graph (torch inlines
``nn.Module`` calls and treats parameters as inputs).

While a ``DeterministicDropout`` is in effect (``parallel/runtime/dropout.py``) the block runs
eagerly: its mask keys (step, call-site counter) are Python ints a compiled graph would guard on,
so each block and each step would compile again. The trainer drops the mode after the first step
for a model without dropout; a model that trains with dropout therefore runs eagerly throughout
(``docs/config.md``). The numbers are the same either way: the compiled block computes what the
eager one does (tests/test_compile.py, against one plain process).

Under TP one function runs eagerly between two graphs: ``linear.column_input`` (its cache is
Python state a graph cannot carry; ``torch.compiler.disable`` on the function itself).
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.parallel.model.meta import decoder_blocks
from shardlm.parallel.runtime.dropout import dropout_active


def _compiled_forward(eager, compiled):
    def forward(*args, **kwargs):
        return eager(*args, **kwargs) if dropout_active() else compiled(*args, **kwargs)

    return forward


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of every decoder block of ``model`` in place; how many."""
    blocks = decoder_blocks(model)
    for block in blocks:
        block.forward = _compiled_forward(block.forward, torch.compile(block.forward))
    return len(blocks)
