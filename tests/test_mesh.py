"""The world mesh ``(dp_replicate, fsdp, cp, tp)`` at cp=1: names, sizes, data-parallel ranks and groups.

TP is innermost, so ranks ``r`` with the same ``r // tp`` form one TP group, see the same batch
and must share a ``dp_rank``; the ``dp_rank`` values cover ``0 .. dp_size - 1`` exactly once per
TP group; the dp group (loss and token counts) holds the ``dp_size`` ranks of one TP position.
A layout whose product is not the process count is refused with one line naming the keys.
"""

import pytest
from helpers import run_ranks

pytestmark = pytest.mark.ranks  # every test here starts processes or a process group

# (dp_replicate, fsdp, tp): HSDP x TP, FSDP x TP, pure FSDP, pure HSDP
LAYOUTS = [(2, 1, 2), (1, 2, 2), (1, 4, 1), (2, 2, 1)]
WRONG = [(2, 2, 2), (1, 1, 3), (1, 1, 1)]


def _describe(layout: tuple[int, int, int]) -> dict:
    """Collective: this layout's mesh as every rank sees it, gathered on all ranks."""
    import torch.distributed as dist

    from shardlm.config import ParallelConfig
    from shardlm.distributed.mesh import build_mesh

    dp_replicate, fsdp, tp = layout
    mesh = build_mesh(ParallelConfig(dp_replicate=dp_replicate, fsdp=fsdp, tp=tp))
    group = mesh.dp_group
    mine = {
        "names": tuple(mesh.world.mesh_dim_names),
        "shape": tuple(mesh.world.shape),
        "tp_size": mesh.tp.size(),
        "dp_mesh_size": mesh.dp.size(),
        "dp_mesh_ndim": mesh.dp.ndim,
        "dp_rank": mesh.dp_rank,
        "dp_group_size": dist.get_world_size(group=group),
        "dp_group_ranks": sorted(dist.get_process_group_ranks(group)),
        "dp_group_again": sorted(dist.get_process_group_ranks(mesh.dp_group)),
        "tp_ranks": sorted(dist.get_process_group_ranks(mesh.tp.get_group())),
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def _mesh_checks() -> dict:
    """Rank body (world 4): every layout, then the refused ones."""
    import os
    import threading

    from shardlm.distributed.mesh import init_distributed
    from shardlm.errors import ConfigError

    init_distributed()
    out = {"layouts": {layout: _describe(layout) for layout in LAYOUTS}, "errors": {}}
    import torch.distributed as dist

    from shardlm.config import ParallelConfig
    from shardlm.distributed.mesh import build_mesh

    pp = build_mesh(ParallelConfig(pp=2, fsdp=2))  # stages outermost: rank r's stage is r // 2
    mine = (pp.pp.get_local_rank(), sorted(dist.get_process_group_ranks(pp.pp.get_group())), pp.dp_rank)
    out["pp"] = [None] * 4
    dist.all_gather_object(out["pp"], (*mine, sorted(dist.get_process_group_ranks(pp.dp_group))))

    # built again: the same groups (distributed/mesh._BUILT), no new gloo threads or sockets
    threads = threading.active_count(), len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))
    again = [build_mesh(ParallelConfig(dp_replicate=r, fsdp=f, tp=t)) for r, f, t in LAYOUTS]
    out["again"] = {
        "same": [m.world is build_mesh(m.parallel).world and m.dp_group is m.dp_group for m in again],
        "threads": (
            threads,
            (threading.active_count(), len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))),
        ),
    }

    for dp_replicate, fsdp, tp in WRONG:
        try:
            build_mesh(ParallelConfig(dp_replicate=dp_replicate, fsdp=fsdp, tp=tp))
            out["errors"][(dp_replicate, fsdp, tp)] = None
        except ConfigError as exc:
            out["errors"][(dp_replicate, fsdp, tp)] = str(exc)
    return out


@pytest.fixture(scope="module")
def meshes() -> dict:
    return run_ranks(_mesh_checks, 4)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "x".join(map(str, t)))
def test_mesh_layout(meshes, layout):
    dp_replicate, fsdp, tp = layout
    dp_size = dp_replicate * fsdp
    ranks = meshes["layouts"][layout]["ranks"]
    assert len(ranks) == 4
    for rank, r in enumerate(ranks):
        assert r["names"] == ("pp", "dp_replicate", "fsdp", "cp", "tp")
        assert r["shape"] == (1, dp_replicate, fsdp, 1, tp)  # pp: test_pipeline.py, cp: test_context_parallel.py
        assert r["tp_size"] == tp
        assert r["dp_mesh_size"] == dp_size
        assert r["dp_mesh_ndim"] == (2 if dp_replicate > 1 else 1)
        # TP innermost: consecutive ranks form a TP group
        assert r["tp_ranks"] == list(range(rank // tp * tp, rank // tp * tp + tp))
        # the dp group: every rank at this rank's TP position
        assert r["dp_group_size"] == dp_size
        assert r["dp_group_ranks"] == list(range(rank % tp, 4, tp))
        assert r["dp_group_again"] == r["dp_group_ranks"]
    dp_ranks = [r["dp_rank"] for r in ranks]
    assert sorted(set(dp_ranks)) == list(range(dp_size))
    for rank in range(4):  # TP ranks share the dp rank (and so the batch); dp ranks run in rank order
        assert dp_ranks[rank] == rank // tp


def test_pp_is_the_outermost_dim(meshes):
    """pp=2 x fsdp=2: ranks 0, 1 are stage 0 (their fsdp group), ranks 2, 3 stage 1; each stage
    group pairs the ranks at one fsdp position."""
    for rank, (stage, stage_ranks, dp_rank, dp_ranks) in enumerate(meshes["pp"]):
        assert stage == rank // 2 and stage_ranks == [rank % 2, rank % 2 + 2]
        assert dp_rank == rank % 2 and dp_ranks == [rank // 2 * 2, rank // 2 * 2 + 1]


def test_a_layout_built_again_reuses_its_groups(meshes):
    """Every layout built a second time in the same process is the same mesh, with no new threads or file
    descriptors (torch's ``init_device_mesh`` makes new gloo groups, each with threads and sockets of its own,
    at every call: the test suite's long-lived ranks ran out of threads that way)."""
    assert all(meshes["again"]["same"])
    before, after = meshes["again"]["threads"]
    assert after == before


@pytest.mark.parametrize("layout", WRONG, ids=lambda t: "x".join(map(str, t)))
def test_layout_not_matching_world_is_refused(meshes, layout):
    message = meshes["errors"][layout]
    assert message is not None, f"{layout} was accepted on 4 processes"
    assert "\n" not in message
    assert "dp_replicate*fsdp*cp*tp" in message and "4 processes" in message
