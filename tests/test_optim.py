"""AdamW and SGD step on each rank's local shards (``train/optim.py``) with torch's numbers.

The reference is torch's own ``AdamW`` / ``SGD`` (foreach) stepping the same DTensor parameters op
by op through DTensor dispatch: after three steps the parameters and every state tensor must be
bit for bit equal, the state still DTensors with their parameter's placements (checkpoints save
them), and no op of the local step may see a DTensor (the point of it). Uneven ``Shard(0)``
pieces (5 rows over 2 ranks), ``Replicate`` and a plain tensor, with and without weight decay.
"""

import pytest
from helpers import run_ranks

pytestmark = pytest.mark.ranks  # every test here starts a process group


def _params(mesh) -> list:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(5, 3, generator=g), torch.randn(4, 6, generator=g), torch.randn(7, generator=g)]
    placements = [[Shard(0)], [Replicate()], [Shard(0)]]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, p)) for t, p in zip(full, placements, strict=True)]
    return params + [torch.nn.Parameter(torch.randn(3, generator=g))]


def _run(make, mesh, steps: int = 3) -> tuple:
    """``steps`` updates with seeded gradients; (parameters, state tensors, ops of steps 2.. that saw a DTensor)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class DTensorOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs or {}))[0])
            return func(*args, **(kwargs or {}))

    params = _params(mesh)
    # the plain tensor in a group of its own: torch's step cannot mix it with DTensors in one foreach call
    opt = make([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:3]}, {"params": params[3:]}])
    g = torch.Generator().manual_seed(1)
    counter = DTensorOps()
    for step in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g)
            p.grad = distribute_tensor(grad, mesh, p.placements) if isinstance(p, DTensor) else grad
        if step == 0:  # the state is made on step 1: ``zeros_like`` of the DTensor parameters
            opt.step()
            continue
        with counter:
            opt.step()
    state = [(k, v) for p in params for k, v in sorted(opt.state[p].items())]
    return params, state, counter.count


def _compare() -> dict:
    """Rank body (world 2): the local-shard optimizers against torch's on DTensors."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from shardlm.train.optim import LocalShardAdamW, LocalShardSGD

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    adamw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)
    cases = {
        "adamw": (lambda g: LocalShardAdamW(g, **adamw), lambda g: torch.optim.AdamW(g, **adamw)),
        "sgd_momentum": (
            lambda g: LocalShardSGD(g, lr=0.1, momentum=0.9, foreach=True),
            lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, foreach=True),
        ),
        "sgd": (lambda g: LocalShardSGD(g, lr=0.1, foreach=True), lambda g: torch.optim.SGD(g, lr=0.1, foreach=True)),
    }
    out = {}
    for name, (local, reference) in cases.items():
        params, state, dtensor_ops = _run(local, mesh)
        ref_params, ref_state, ref_ops = _run(reference, mesh)
        out[name] = {
            "params_equal": all(torch.equal(a.detach(), b.detach()) for a, b in zip(params, ref_params, strict=True)),
            "state_keys": [k for k, _ in state] == [k for k, _ in ref_state],
            "state_equal": all(torch.equal(a, b) for (_, a), (_, b) in zip(state, ref_state, strict=True)),
            "state_layouts": [
                (type(a).__name__, getattr(a, "placements", None)) == (type(b).__name__, getattr(b, "placements", None))
                for (_, a), (_, b) in zip(state, ref_state, strict=True)
            ],
            "state_dtensors": sum(isinstance(v, DTensor) for _, v in state),
            "dtensor_ops": dtensor_ops,
            "reference_dtensor_ops": ref_ops,
        }
    return out


def test_local_shard_optimizers_equal_torch_on_dtensors():
    got = run_ranks(_compare, 2)
    for name, r in got.items():
        assert r["params_equal"] and r["state_keys"] and r["state_equal"], (name, r)
        assert all(r["state_layouts"]), (name, r)
        assert r["dtensor_ops"] == 0 and r["reference_dtensor_ops"] > 0, (name, r)
    assert got["adamw"]["state_dtensors"] == 2 * 3  # exp_avg, exp_avg_sq of the 3 DTensor parameters
    assert got["sgd_momentum"]["state_dtensors"] == 3  # momentum_buffer, made on step 1 from a local gradient
