"""Start N local ranks with torch's elastic launcher, or run in this process under torchrun.

Used by the CLI and by the tests, so the code path users take is the one that is tested.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def spawn(fn: Callable, nproc: int, *args: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks (gloo/NCCL rendezvous on localhost).

    Returns ``{rank: return value}``. A failing rank stops all others and raises ``RankFailed``.
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        return elastic_launch(config, fn)(*args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", str(message))
        last = str(message).strip().splitlines()[-1] if message else f"exit code {failure.exitcode}"
        raise RankFailed(f"rank {rank} failed: {last}") from None


class RankFailed(RuntimeError):
    """A worker process failed; the message names the rank and its last error line."""
