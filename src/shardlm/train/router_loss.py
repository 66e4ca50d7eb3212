"""The router's load-balancing loss over the global batch, as one process computes it.

With ``output_router_logits`` on, transformers' mixture-of-experts models add
``router_aux_loss_coef * aux_loss`` to their loss, where ``aux_loss`` is the family's
``load_balancing_loss_func(router_logits, num_experts, top_k)``: ``E * sum_e f_e * P_e``, with
``f_e`` the share of the top-k assignments that went to expert ``e`` and ``P_e`` its mean router
probability, both over every row (token) of every layer of the batch. A product of two batch means
is not linear in the batch: the mean of per-rank aux losses is not the global one. So each rank
sums its own rows (``router_sums``: assignment counts ``c``, which carry no gradient (top-k),
probability sums ``s`` and the row count ``n``, over layers), one all-reduce over the
data-parallel ranks gives the global ``C``, ``S``, ``N``, and each rank backpropagates
``coef * E * (C . s) / N**2``: the data-parallel gradient sum (FSDP2, divide factor 1) makes that
exactly the gradient of ``coef * E * (C . S) / N**2``, one process's term. Under TP every rank of
a TP group holds the same tokens and a whole router (``replicate_local``): each computes the same
term, and its gradient lands on replicated parameters and activations, which TP does not sum, so
it counts once. Under expert parallelism (``parallel/runtime/ep.py``) the EP ranks are data-parallel ranks
with tokens of their own and the router stays whole on each, before any token is dispatched: the
same sums over the same data-parallel group.

The trainer passes no attention mask (every row is a token, as in one process given the same
inputs), so rows are not masked. The global counts must be known before the first backward of a
step: with gradient accumulation they are known only after the last micro-step's forward, so
``gradient_accumulation_steps > 1`` with the loss on is refused before spawning (``check``), as is
a family whose ``load_balancing_loss_func`` these sums do not reproduce (a probe on random logits
split over two ranks, against the family's own function).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardlm.errors import ConfigError

_ATTRS = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")


@dataclass(frozen=True)
class RouterLoss:
    """``coef * aux_loss`` of a model whose config turns the router's load-balancing loss on."""

    coef: float
    num_experts: int
    top_k: int

    def sums(self, router_logits: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (assignment counts ``[E]``, probability sums ``[E]`` (with gradient), rows),
        summed over layers, as transformers' ``load_balancing_loss_func`` accumulates them."""
        counts = torch.zeros(self.num_experts, device=router_logits[0].device)
        probs = torch.zeros(self.num_experts, device=router_logits[0].device)
        rows = 0
        for layer in router_logits:
            weights = torch.softmax(layer, dim=-1)
            chosen = torch.topk(weights, self.top_k, dim=-1).indices.reshape(-1)
            counts = counts + torch.bincount(chosen, minlength=self.num_experts).float()
            probs = probs + weights.float().sum(dim=0)
            rows += weights.shape[0]
        return counts, probs, torch.tensor(float(rows), device=counts.device)

    def terms(self, router_logits: tuple[torch.Tensor, ...], all_reduce_dp) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's term to backpropagate, the global ``coef * aux_loss``): ``all_reduce_dp``
        sums a tensor over the data-parallel ranks in place (one all-reduce of ``2E + 1`` values)."""
        counts, probs, rows = self.sums(router_logits)
        both = all_reduce_dp(torch.cat([counts, probs.detach(), rows.view(1)]))
        total_counts, total_probs, total_rows = both[: self.num_experts], both[self.num_experts : -1], both[-1]
        scale = self.coef * self.num_experts / total_rows**2
        return scale * (total_counts * probs).sum(), scale * (total_counts * total_probs).sum()


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The load-balancing loss ``model`` adds to its loss, or None (``output_router_logits`` off or
    a coefficient of 0): read from the attributes its ``forward`` reads."""
    coef = getattr(model, "router_aux_loss_coef", None)
    if not getattr(model.config, "output_router_logits", False) or not coef:
        return None
    return RouterLoss(float(coef), int(model.num_experts), int(model.num_experts_per_tok))


def _probe(model: nn.Module, loss: RouterLoss) -> str | None:
    """Why these sums do not give the family's own ``load_balancing_loss_func`` (None: they do):
    random logits of 2 layers, 11 rows, split 5 + 6 over two ranks."""
    family = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if family is None:
        return f"{type(model).__module__} has no load_balancing_loss_func"
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(11, loss.num_experts, generator=g, dtype=torch.float64) for _ in range(2)]
    want = float(family(tuple(layers), loss.num_experts, loss.top_k))
    ranks = [loss.sums(tuple(layer[part] for layer in layers)) for part in (slice(0, 5), slice(5, 11))]
    summed = torch.cat([(ranks[0][i] + ranks[1][i]).view(-1) for i in range(3)])
    _, total = loss.terms(tuple(layer[:5] for layer in layers), lambda local: summed)
    got = float(total) / loss.coef
    if abs(got - want) > 1e-6 * max(abs(want), 1e-12):
        return f"its load_balancing_loss_func gives {want:.6g} where the summed statistics give {got:.6g}"
    return None


def requested(model_path: str) -> bool:
    """The config at ``model_path`` turns the load-balancing loss on (``output_router_logits`` and a
    coefficient not 0, on the model's config or its text config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    configs = [c for c in (config, getattr(config, "text_config", None)) if c is not None]
    return any(getattr(c, "output_router_logits", False) and getattr(c, "router_aux_loss_coef", 0) for c in configs)


def check(model: nn.Module, accumulation_steps: int) -> None:
    """Before spawning, for a config that ``requested`` the loss: refuse what the global
    load-balancing loss cannot do yet (see the module docstring), and a model whose own
    attributes would not turn it on in the trainer (set on a text config the model does not
    read it from): never dropped silently. ``model``: the meta model."""
    missing = [a for a in _ATTRS if not isinstance(getattr(model, a, None), (int, float))]
    if missing:
        why = f"{type(model).__name__} has no {missing[0]}"
    elif router_loss_of(model) is None:
        why = f"{type(model).__name__} does not turn it on from its own config and router_aux_loss_coef"
    else:
        why = _probe(model, router_loss_of(model))
    if why:
        raise ConfigError(
            f"model: output_router_logits=true adds the router's load-balancing loss, which shardlm computes "
            f"over the global batch for transformers' load_balancing_loss_func only ({why}); set "
            "output_router_logits to false in config.json to train the language-model loss alone"
        )
    if accumulation_steps > 1:
        raise ConfigError(
            f"train.gradient_accumulation_steps: {accumulation_steps} with the router's load-balancing loss "
            "(output_router_logits=true): its expert counts over the global batch are needed before the first "
            "backward; set it to 1 (raise train.per_device_train_batch_size instead)"
        )
