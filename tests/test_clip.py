"""Global gradient clipping over every placement and mesh equals torch's on the full tensors.

Gradients of one model live as DTensors on the 2-D ``(fsdp, tp)`` mesh (FSDP x TP), on the
1-D TP mesh (replicated norms), and as plain tensors. ``shardlm.clip.clip_grad_norm_`` must
return the norm ``torch.nn.utils.clip_grad_norm_`` computes on plain full copies and scale
every gradient by the same factor; with ``max_norm <= 0`` it only measures.
"""

import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.ranks  # every test here starts processes or a process group

# name -> (full shape, mesh "2d" | "tp" | None for a plain tensor, placements)
GRADS = {
    "fsdp_tp_2d": ((4, 6), "2d", ("S0", "S1")),
    "replicate_shard": ((6, 4), "2d", ("R", "S0")),
    "uneven_5_over_2": ((5, 3), "2d", ("S0", "R")),
    "uneven_tp_7": ((7,), "tp", ("S0",)),
    "tp_replicate": ((3,), "tp", ("R",)),
    "plain": ((2, 3), None, ()),
}
# max_norm -> what it exercises (the total norm of the gradients below is about 25.5)
CASES = {"binds": 1.0, "does_not_bind": 1.0e6, "measure_only": 0.0}


def _full_grads(seed: int) -> dict[str, torch.Tensor]:
    """The same full gradients on every rank (a fixed seed), of different scales."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * (i + 1) for i, (name, (shape, _, _)) in enumerate(GRADS.items())}


def _placements(spec: tuple[str, ...]) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]


def _sharded_params(full: dict[str, torch.Tensor], meshes: dict) -> list[torch.nn.Parameter]:
    """Parameters whose ``.grad`` has the placement of ``GRADS`` (DTensor params for DTensor grads)."""
    from torch.distributed.tensor import distribute_tensor

    params = []
    for name, (_, mesh_name, spec) in GRADS.items():
        if mesh_name is None:
            param = torch.nn.Parameter(torch.zeros_like(full[name]))
            param.grad = full[name].clone()
        else:
            mesh, placements = meshes[mesh_name], _placements(spec)
            param = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full[name]), mesh, placements))
            param.grad = distribute_tensor(full[name].clone(), mesh, placements)
        params.append(param)
    return params


def _as_full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _clip_checks() -> dict:
    """Rank body (world 4 = fsdp 2 x tp 2): every case against torch on plain full copies."""
    from shardlm.config import ParallelConfig
    from shardlm.distributed.clip import clip_grad_norm_
    from shardlm.distributed.mesh import build_mesh, init_distributed

    init_distributed()
    mesh = build_mesh(ParallelConfig(dp_replicate=1, fsdp=2, tp=2))
    meshes = {"2d": mesh.world["fsdp", "tp"], "tp": mesh.tp}
    out = {}
    for case, max_norm in CASES.items():
        full = _full_grads(seed=7)
        params = _sharded_params(full, meshes)
        norm = clip_grad_norm_(params, max_norm)
        ref_params = [torch.nn.Parameter(torch.zeros_like(t)) for t in full.values()]
        for p, t in zip(ref_params, full.values()):
            p.grad = t.clone()
        if max_norm > 0:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
        else:  # torch would scale everything to 0: measure only
            ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_params])
        out[case] = {
            "norm": norm.item(),
            "ref_norm": ref_norm.item(),
            "max_abs_diff": max((_as_full(p.grad) - r.grad).abs().max().item() for p, r in zip(params, ref_params)),
            "unchanged": all(torch.equal(_as_full(p.grad), t) for p, t in zip(params, full.values())),
        }
    try:  # why clip.py exists: torch's own clipping on this mixed list
        torch.nn.utils.clip_grad_norm_(_sharded_params(_full_grads(seed=7), meshes), 1.0)
        out["torch_mixed_error"] = None
    except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
        out["torch_mixed_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return out


def test_clip_over_mixed_placements_matches_torch_on_full_tensors():
    got = run_ranks(_clip_checks, 4)
    for case, max_norm in CASES.items():
        r = got[case]
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-6 * r["ref_norm"], (case, r)
        assert r["max_abs_diff"] <= 1e-6, (case, r)
        if case == "binds":
            assert r["ref_norm"] > 5 * max_norm and not r["unchanged"], r
        else:  # not binding or measuring only: gradients are left exactly as they were
            assert r["ref_norm"] < max_norm or max_norm == 0
            assert r["unchanged"], (case, r)
    # torch's clip_grad_norm_ stacks per-tensor norms and cannot mix DTensor meshes and plain tensors
    # (torch 2.13: "RuntimeError: aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor ...")
    assert got["torch_mixed_error"] is not None and "mixed" in got["torch_mixed_error"], got


def test_clip_one_process_plain_tensors():
    """Without a process group, plain tensors: exactly torch's clipping."""
    from shardlm.distributed.clip import clip_grad_norm_

    full = _full_grads(seed=3)
    ours = [torch.nn.Parameter(torch.zeros_like(t)) for t in full.values()]
    ref = [torch.nn.Parameter(torch.zeros_like(t)) for t in full.values()]
    for a, b, t in zip(ours, ref, full.values()):
        a.grad, b.grad = t.clone(), t.clone()
    norm = clip_grad_norm_(ours, 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert abs(norm.item() - ref_norm.item()) <= 1e-6 * ref_norm.item()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
