"""Rank processes kept alive between tests, so that a test pays for its computation, not for
starting Python, torch, transformers and peft again (~8 s a rank on this machine's two cores).

``run(fn, world_size, *args)`` runs ``fn(*args)`` on ``world_size`` real processes with gloo on
localhost, as ``shardlm.distributed.launch.spawn`` does: each gets ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``, and the job's ``init_distributed()`` finds the process group
the worker joined when it started. That group lives as long as the worker: destroying it between
jobs is not safe, because DTensor caches sharding decisions keyed by meshes that compare equal
across jobs (same layout and names) and would hand a later job a mesh whose groups are gone.
Kept alive, such a mesh's groups still exist and hold the same ranks. Before each job a worker
re-seeds torch's default generator to what a fresh process starts with; a job that fails or
times out takes its workers down, and the next job starts new ones; a job that times out reports every
waiting rank's Python stacks (``faulthandler`` on SIGUSR1), so a hang in CI says where it waits. Each job's output (fd 1
and 2 of every rank) is printed by the test process, so pytest shows it with the test that ran it.

Tests of the launcher itself, and tests that measure a process's memory, use the launcher
(``spawn``), which starts new processes every time.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

# under pytest-timeout's 600 s (pyproject.toml), so that a stuck job fails here, with every rank's stacks
JOB_TIMEOUT_S = 480
_POOLS: dict[int, list] = {}  # world size -> [(process, connection, its stacks file)]


class RankError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn, stacks_path: str) -> None:
    import torch

    from shardlm import init_distributed

    fresh_seed = torch.initial_seed()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="localhost",
        MASTER_PORT=str(port),
    )
    stacks = open(stacks_path, "w")  # noqa: SIM115 - open as long as the worker: the signal handler writes to it
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    init_distributed()
    while True:
        job = conn.recv()
        if job is None:
            return
        fn, args = job
        torch.manual_seed(fresh_seed)
        with tempfile.TemporaryFile() as out:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            try:
                result = ("ok", fn(*args))
            except BaseException:  # noqa: BLE001 - reported to the test process, which raises
                result = ("error", traceback.format_exc())
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
            out.seek(0)
            text = out.read().decode(errors="replace")
        conn.send((*result, text))


def _start(world_size: int) -> list:
    ctx = mp.get_context("spawn")
    port = _free_port()
    workers = []
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        fd, stacks = tempfile.mkstemp(prefix=f"shardlm-pool-{world_size}-{rank}-", suffix=".txt")
        os.close(fd)
        proc = ctx.Process(target=_worker, args=(rank, world_size, port, child, stacks), daemon=True)
        proc.start()
        child.close()
        workers.append((proc, parent, stacks))
    return workers


def shutdown(world_size: int | None = None, kill: bool = False) -> None:
    """Stop the workers of one world size (all when None); ``kill``: at once (a failed job's
    other ranks may be waiting in a collective)."""
    for size in [world_size] if world_size is not None else list(_POOLS):
        for proc, conn, stacks in _POOLS.pop(size, []):
            if not kill:
                try:
                    conn.send(None)
                except OSError:
                    pass
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
            proc.join()
            os.unlink(stacks)


def _stacks(workers: list, ranks: list[int]) -> str:
    """The Python stacks of ``ranks`` (every thread), as each worker's faulthandler writes them on SIGUSR1."""
    for rank in ranks:
        os.kill(workers[rank][0].pid, signal.SIGUSR1)
    time.sleep(2)
    return "".join(f"--- rank {r} stacks ---\n{open(workers[r][2]).read()[-4000:]}" for r in ranks)


def run(fn, world_size: int, *args):
    """``fn(*args)`` on ``world_size`` pooled ranks; ``{rank: result}``. The first rank to fail
    stops the others and raises ``RankError`` with its traceback and output."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    if world_size not in _POOLS:
        _POOLS[world_size] = _start(world_size)
    workers = _POOLS[world_size]
    replies: dict[int, tuple] = {}
    try:
        for _, conn, _ in workers:
            conn.send((fn, args))
        pending = {conn: rank for rank, (_, conn, _) in enumerate(workers)}
        while pending:
            ready = wait(list(pending), timeout=JOB_TIMEOUT_S)
            if not ready:
                waiting = sorted(pending.values())
                raise RankError(f"ranks {waiting} gave no result in {JOB_TIMEOUT_S} s\n{_stacks(workers, waiting)}")
            for conn in ready:
                rank = pending.pop(conn)
                replies[rank] = conn.recv()
                if replies[rank][0] == "error":
                    raise RankError(f"rank {rank} failed:\n{replies[rank][1]}\n{replies[rank][2]}")
    except (EOFError, OSError, RankError) as exc:
        shutdown(world_size, kill=True)  # the others may wait in a collective; not trusted again
        raise RankError(f"{fn.__name__} on {world_size} ranks: {exc or type(exc).__name__}") from None
    except BaseException:
        # pytest-timeout's failure, a KeyboardInterrupt: the workers are still inside this job, and the next
        # test's job would wait behind it (CI lost four 4-rank tests to one stuck job this way)
        shutdown(world_size, kill=True)
        raise
    for rank in sorted(replies):
        if replies[rank][2]:
            sys.stdout.write(f"--- rank {rank} ---\n{replies[rank][2]}")
    return {rank: value for rank, (_, value, _) in replies.items()}
