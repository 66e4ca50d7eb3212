"""An LM head with parameters of its own beside its weight, acting per vocabulary column (Dory's ``logit_scale``).

The ``lm_head`` style splits the output projection by vocabulary rows and keeps the logits split (the loss
runs on the shards). A head class that owns more parameters than ``weight``/``bias`` and uses them in its
forward (Dory's ``DoryLMHead``: ``logits * logit_scale``, one learned scale per token) can keep that style
only where each of them acts on its own vocabulary columns: then each rank holds its rows of them too
(``Shard(0)``) and runs the head's own forward on its local pieces (``runtime/linear.Colwise``). That is
checked, not assumed: the forward run on a head of a few random vocabulary rows must give, with only some
of those rows of every parameter, exactly those columns of the logits (``acts_per_column``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from shardlm.parallel.infer.refusals import cannot_split
from shardlm.parallel.model.hf import extra_params

_ROWS = 4  # vocabulary rows of the probe: two ranks' halves of two rows each


def acts_per_column(module: nn.Module, vocab: int) -> bool:
    """Whether ``module`` (an LM head of ``vocab`` rows) computes each logit column from that row of every
    parameter alone: run on CPU with ``_ROWS`` random rows of each parameter (its dim 0, which must be
    ``vocab`` long) and again with each half of them, the halves' logits must be the columns of the whole's."""
    params = dict(module.named_parameters(recurse=False))
    if any(p.dim() == 0 or p.shape[0] != vocab for p in params.values()):
        return False
    with torch._C.DisableTorchFunction(), torch.no_grad():  # outside the meta device and any trace
        g = torch.Generator().manual_seed(0)
        rows = {n: torch.randn((_ROWS, *p.shape[1:]), generator=g) for n, p in params.items()}
        x = torch.randn(3, params["weight"].shape[-1], generator=g)
        whole = _run(module, rows, x)
        if not isinstance(whole, torch.Tensor) or whole.shape[-1] != _ROWS:
            return False
        half, scale = _ROWS // 2, float(whole.abs().max())  # a matmul's rounding differs with its width
        for a in (0, half):
            got = _run(module, {n: r[a : a + half] for n, r in rows.items()}, x)
            want = whole[..., a : a + half]
            if not isinstance(got, torch.Tensor) or not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * scale):
                return False
    return True


def _run(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor):
    """``module``'s own forward (not its hooks) on ``x``, with ``params`` in place of its parameters."""
    probe = copy.copy(module)  # shallow: its parameters are replaced, the module itself is not touched
    probe._parameters = {**module._parameters, **params}  # None entries too (a Linear without bias)
    try:
        return type(module).forward(probe, x)
    except Exception:  # noqa: BLE001 - a forward this probe cannot run: not placed
        return None


def check_vocab_head(model: nn.Module, plan) -> None:
    """Refuse an ``lm_head`` with parameters of its own beside its weight that do not act per vocabulary
    column (``acts_per_column``): the vocabulary-parallel style could not place them."""
    for fqn, style in plan.styles.items():
        module = model.get_submodule(fqn)
        extra = extra_params(module) if style == "lm_head" else []
        if extra and not acts_per_column(module, module.weight.shape[0]):
            raise cannot_split(
                f"{fqn} ({type(module).__name__}), the LM head, uses parameters of its own ({', '.join(extra)}) "
                "other than per vocabulary column, which the vocabulary-parallel style cannot place"
            )
