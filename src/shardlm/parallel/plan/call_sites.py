"""Call sites: the calls ``runtime/dropout.py`` takes over, recognized with their arguments: dropout
(``F.dropout``, sdpa's ``dropout_p``) and the random draws of a forward in training (a router's jitter:
Mixtral's ``empty_like(h).uniform_(1 - eps, 1 + eps)``, Phi-MoE's Gumbel sampling ``exponential_()`` and
``rand_like``). The trace counts them (``infer/tracker.py``) and the runtime keys each by the same count,
so both read them here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the random draws taken over, their values hashes of the key as dropout masks are. Only these:
# the forwards of transformers' causal LMs draw with them (router jitter; Reformer's LSH attention draws
# its random rotations with ``torch.randn`` after reseeding from the OS in every layer, so each process
# would draw its own) and with nothing else but ``torch.rand([])`` for LayerDrop (refused on more than one
# process: ``runtime/dropout.check_layerdrop``)
RANDOM_DRAWS = (torch.rand_like, torch.Tensor.uniform_, torch.Tensor.exponential_, torch.randn)


def drawn_size(args, kwargs) -> tuple[int, ...]:
    """The size ``torch.randn`` was asked for: ``randn(2, 3)``, ``randn((2, 3))`` or ``randn(size=...)``."""
    return tuple(int(n) for n in drawn_sizes(args, kwargs))


def drawn_sizes(args, kwargs) -> tuple:
    """``drawn_size`` as the call passed them (the trace's ``NamedInt`` attributes among them)."""
    return tuple(kwargs.get("size", args[0] if len(args) == 1 and not isinstance(args[0], int) else args))


def is_random_draw(func) -> bool:
    return any(func is draw for draw in RANDOM_DRAWS)


def is_call_site(func) -> bool:
    """Every call ``DeterministicDropout`` keys by its count: dropout and the random draws."""
    return is_dropout_call(func) or is_random_draw(func)


def is_dropout_call(func) -> bool:
    """The calls ``DeterministicDropout`` takes over (each one is a call site, whatever its p)."""
    return func is F.dropout or func is F.scaled_dot_product_attention


def dropout_args(args, kwargs) -> tuple[torch.Tensor, float, bool, bool]:
    names, defaults = ("input", "p", "training", "inplace"), (None, 0.5, True, False)
    values = [args[i] if i < len(args) else kwargs.get(n, d) for i, (n, d) in enumerate(zip(names, defaults))]
    return tuple(values)


_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None)


def sdpa_args(args, kwargs) -> dict:
    pairs = enumerate(zip(_SDPA_NAMES, _SDPA_DEFAULTS))
    out = {n: args[i] if i < len(args) else kwargs.get(n, d) for i, (n, d) in pairs}
    out["enable_gqa"] = kwargs.get("enable_gqa", False)
    return out


def dropout_p(func, args, kwargs) -> float:
    """The probability a dropout call was given (0 where it is the identity: not training); 1 for a
    random draw (it always draws)."""
    if is_random_draw(func):
        return 1.0
    if func is F.scaled_dot_product_attention:
        return float(sdpa_args(args, kwargs)["dropout_p"])
    _, p, training, _ = dropout_args(args, kwargs)
    return float(p) if training else 0.0


def dropout_input_shape(func, args, kwargs, x) -> tuple[int, ...]:
    """Shape of the tensor a dropout call masks (for attention: ``[batch, heads, q, k]`` probabilities)."""
    if func is torch.randn:
        return drawn_size(args, kwargs)
    if func is F.scaled_dot_product_attention:
        a = sdpa_args(args, kwargs)
        return (*a["query"].shape[:-1], a["key"].shape[-2])
    return tuple(x.shape)
