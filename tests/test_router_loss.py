"""The router's load-balancing loss over the global batch (``train/router_loss.py``), process-free:
per-rank sums, reduced over two simulated data-parallel ranks, give transformers' own
``load_balancing_loss_func`` on the whole batch, value and gradient, where the mean of per-rank
losses does not; and the refusals before spawning. Parity of whole runs (tp=2, fsdp=2) is in
``test_moe.py``'s spawns."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import load_checked

from shardlm import ConfigError
from shardlm.train.router_loss import RouterLoss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tiny import tiny_config  # noqa: E402


def test_summed_over_ranks_it_is_the_global_loss_and_gradient():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    loss, rows, split = RouterLoss(coef=0.5, num_experts=4, top_k=2), 13, (6, 7)
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(rows, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    want = loss.coef * load_balancing_loss_func(tuple(layers), 4, 2)
    want.backward()
    expected = [layer.grad.clone() for layer in layers]
    for layer in layers:
        layer.grad = None
    parts = [tuple(layer.split(split)[r] for layer in layers) for r in range(2)]
    stats = [torch.cat([s.detach().view(-1) for s in loss.sums(part)]) for part in parts]
    for r in range(2):  # each rank: its own sums plus the other rank's (the all-reduce)
        term, total = loss.terms(parts[r], lambda local, r=r: local + stats[1 - r])
        term.backward()
        torch.testing.assert_close(total, want.detach().float(), rtol=1e-6, atol=0)
    for layer, grad in zip(layers, expected):
        torch.testing.assert_close(layer.grad, grad, rtol=1e-5, atol=1e-9)  # fp32 sums, as transformers
    # what averaging per-rank losses would give instead: measurably not the same loss
    mean = sum(loss.coef * load_balancing_loss_func(part, 4, 2).detach() for part in parts) / 2
    assert abs(float(mean) - want.item()) > 1e-4 * want.item()


def test_what_it_cannot_do_is_refused_before_spawning(tmp_path, monkeypatch):
    """Gradient accumulation (the global counts come after the last micro-step's forward) and a
    family whose own function the sums do not reproduce: one line each. Off (the default) or a
    coefficient of 0: nothing to refuse."""
    (tmp_path / "data.txt").write_text("hello world\n")
    config = tiny_config("mixtral")
    assert config.output_router_logits is False
    config.output_router_logits = True
    config.save_pretrained(tmp_path / "aux")
    raw = {"model": str(tmp_path / "aux"), "data": {"path": str(tmp_path / "data.txt")}}
    assert load_checked(raw=raw).model == str(tmp_path / "aux")
    with pytest.raises(ConfigError, match=r"^train.gradient_accumulation_steps: 2 with the router") as info:
        load_checked(raw={**raw, "train": {"gradient_accumulation_steps": 2}})
    assert "\n" not in str(info.value)
    import transformers.models.mixtral.modeling_mixtral as mixtral

    monkeypatch.setattr(mixtral, "load_balancing_loss_func", lambda logits, n, k: torch.tensor(1.0))
    with pytest.raises(ConfigError, match=r"^model: output_router_logits=true .* gives 1 where the summed"):
        load_checked(raw=raw)
    config.router_aux_loss_coef = 0.0  # asks for the logits only: nothing added to the loss
    config.save_pretrained(tmp_path / "aux")
    assert load_checked(raw={**raw, "train": {"gradient_accumulation_steps": 2}}).model == str(tmp_path / "aux")
