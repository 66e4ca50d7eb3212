"""Which models keep documents apart in a packed window (``data.packing_strategy: bfd``).

The trainer passes document-packed windows to the model as ``input_ids`` and ``position_ids`` that
restart at each document, with no attention mask (``train/trainer.py``). transformers 5 turns
such position ids into a block-diagonal causal mask itself (``masking_utils``:
``find_packed_sequence_indices`` when ``attention_mask`` and the cache are None, and-ed into the
causal, sliding-window and chunked masks it builds for sdpa, eager and flex attention). That holds
for a model exactly when:

* its forward takes ``position_ids`` (they also restart rotary and learned positions: GPT-2, OPT);
* its mask is built through ``masking_utils`` (``create_causal_mask`` and its siblings) and the
  call hands it ``position_ids`` (a keyword, or a ``**kwargs`` dict with that key) - a model that
  builds its own mask, or calls the builder without them, never sees the document boundaries
  (OPT in transformers 5.24: its positions follow ``position_ids`` but its mask does not);
* no mixer carries anything along the sequence besides attention: a recurrent state or a short
  convolution (Mamba, Gated DeltaNet, short-conv hybrids; recognised by their depthwise
  ``Conv1d``, as ``estimate/mixers.py`` does) runs straight across a document boundary.

A table of rules, not of names: ``tests/test_packing.py`` checks it numerically against every
tested family (two documents packed give the logits each gives alone, or the family is refused).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from shardlm.config import Config
from shardlm.errors import ConfigError
from shardlm.parallel.model.hf import is_depthwise_conv

MASK_BUILDERS = (
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "create_chunked_causal_mask",
    "create_masks_for_generate",
)


def _name(node: ast.AST) -> str | None:
    return getattr(node, "id", getattr(node, "attr", None))


def _builds_document_mask(cls: type) -> bool:
    """Whether ``cls.forward`` calls a ``masking_utils`` mask builder (or a local name bound to one,
    as Mistral's ``mask_function``) and hands it the position ids."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    nodes = list(ast.walk(tree))
    builders = set(MASK_BUILDERS)
    for node in nodes:
        if isinstance(node, ast.Assign) and any(_name(n) in MASK_BUILDERS for n in ast.walk(node.value)):
            builders |= {_name(t) for t in node.targets}
    keys = {k.value for node in nodes if isinstance(node, ast.Dict) for k in node.keys if isinstance(k, ast.Constant)}
    for node in nodes:
        if isinstance(node, ast.Call) and _name(node.func) in builders:
            if any(k.arg == "position_ids" or (k.arg is None and "position_ids" in keys) for k in node.keywords):
                return True
    return False


def packing_refusal(model: nn.Module) -> str | None:
    """Why ``model`` (meta is fine) cannot keep packed documents apart, or None when it can."""
    name = type(model).__name__
    if "position_ids" not in inspect.signature(type(model).forward).parameters:
        return f"{name}'s forward takes no position_ids"
    mixers = sorted({type(m).__name__ for m in model.modules() for c in m.children() if is_depthwise_conv(c)})
    if mixers:
        return f"{name}'s {mixers[0]} carries a recurrent state or convolution across document boundaries"
    if not any(_builds_document_mask(cls) for cls in {type(m) for m in model.modules()}):
        return (
            f"{name} does not build its attention mask from position_ids through transformers' masking_utils, "
            "so it ignores document boundaries"
        )
    return None


def check_packing(cfg: Config, model: nn.Module) -> None:
    """Refuse document packing (the default with ``data.packing``) for a model that cannot honour it."""
    if not cfg.data.packing or cfg.data.packing_strategy != "bfd":
        return
    why = packing_refusal(model)
    if why is not None:
        raise ConfigError(
            f"data.packing_strategy: 'bfd' packs documents apart, but {why}; set data.packing_strategy: wrapped "
            "(documents attend to each other, pretraining-style) or data.packing: false"
        )
