"""Answers on the meta device to the data-dependent questions modeling files ask during the trace.

The trace runs on meta tensors, which hold no data; a modeling file may still ask about values
(``pad_token_id in input_ids``, ``mask.all()``, ``.item()``, ``nonzero``: is this a packed
sequence?). Each gets the answer of an ordinary batch with nothing special in it (no pad token, no
element matching), so the forward takes its plain path.
"""

from __future__ import annotations

import torch

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


def asks_data(name: str, args: tuple) -> bool:
    """Whether the torch function ``name`` called with ``args`` asks a meta tensor for its data."""
    return (
        bool(args)
        and isinstance(args[0], torch.Tensor)
        and args[0].is_meta
        and (name in _DATA_DEPENDENT or name in _NO_ROWS)
    )


def meta_answer(name: str, args: tuple, kwargs: dict):
    """The answer to ``asks_data``'s question: a fixed value, or no rows for ``nonzero``/``argwhere``."""
    if name in _DATA_DEPENDENT:
        return _DATA_DEPENDENT[name]
    if kwargs.get("as_tuple") or (len(args) > 1 and args[1] is True):
        return tuple(torch.empty(0, dtype=torch.long, device="meta") for _ in range(args[0].dim()))
    return torch.empty((0, args[0].dim()), dtype=torch.long, device="meta")
