"""Start N local ranks with torch's elastic launcher, or run in this process under torchrun.

Used by the CLI and by the tests, so the code path users take is the one that is tested.

Faults (see also ``train/faults.py``):
  * a rank that dies (killed, segfault, exception) makes the agent stop the others (SIGTERM,
    then SIGKILL after ``shutdown_timeout``) and ``spawn`` raises ``RankFailed`` naming the rank
    that failed first. A rank killed by a signal is preferred over one that raised at about the
    same time: the others' errors are then consequences (their collective lost a peer);
  * a launcher that dies (kill -9, OOM killer) takes its ranks with it: each rank asks Linux
    for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, ``RankEntry``), so no rank
    keeps computing, or writing into the output directory, for a launcher that is gone. The
    previous checkpoint stays whole (saves are atomic, ``checkpoint/layout.py``) and the next
    save or run removes the dead ``.tmp-`` directory;
  * SIGTERM to the launching process is forwarded to the workers, which save a checkpoint at a
    step they agree on and return normally, so ``spawn`` returns and the CLI exits 0. The
    elastic agent therefore handles only SIGINT, SIGHUP and SIGQUIT itself (stop at once).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardlm.distributed.mesh import init_distributed
from shardlm.errors import ConfigError

AGENT_SIGNALS = ("SIGINT", "SIGHUP", "SIGQUIT")  # the elastic agent stops the workers at once on these
SHUTDOWN_TIMEOUT_S = 30  # after a failure: seconds between the agent's SIGTERM to the others and SIGKILL


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """This process gets SIGKILL when its parent dies (Linux; elsewhere nothing happens). If the
    parent is already gone (it died before this call), exit now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no prctl
        return
    if os.getppid() != parent:
        os._exit(1)


class RankEntry:
    """What each spawned rank runs: ``die_with_parent`` (the launcher's pid, recorded here when
    the launcher builds it), then ``fn``. A ``ConfigError`` (a problem only a rank can see, such
    as a full disk at save: ``errors.OutOfSpace``) ends the rank with exit code 2 and its one
    line in ``messages/RANK``, which the launcher reports instead of tracebacks. A class, so it
    pickles for the ``spawn`` start method; ``__name__``/``__qualname__`` name the entry point."""

    def __init__(self, fn: Callable, messages: str):
        self.fn, self.parent, self.messages = fn, os.getpid(), messages
        self.__name__ = self.__qualname__ = getattr(fn, "__qualname__", "rank")

    def __call__(self, *args: Any) -> Any:
        die_with_parent(self.parent)
        try:
            return self.fn(*args)
        except ConfigError as exc:
            with open(os.path.join(self.messages, os.environ.get("RANK", "0")), "w") as fh:
                fh.write(str(exc))
            sys.exit(2)  # SystemExit: no traceback from the process or the elastic agent


QUIETED = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


class _QuietCleanFailures(logging.Filter):
    """Once a rank left its one line in ``messages``, drop the launcher's log of the teardown (the
    agent's traceback of that rank's exit, "Terminating process ... via signal SIGTERM")."""

    def __init__(self, messages: str):
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return not os.listdir(self.messages)


def _messages(folder: str) -> dict[int, str]:
    out = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as fh:
            out[int(name)] = fh.read().strip()
    return out


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def checked_on_rank0(check: Callable[[], None], timeout_s: float) -> None:
    """Collective, under torchrun (every rank is its own launcher): rank 0 runs ``check`` (what the
    CLI otherwise does once before spawning) and every rank raises the ``ConfigError`` it raised, so
    the whole job stops with the same one line instead of rank 0 alone while the others wait.
    ``check`` must not be collective itself: the other ranks are waiting in the broadcast."""
    init_distributed(timeout_s)
    problem = [""]
    if dist.get_rank() == 0:
        try:
            check()
        except ConfigError as exc:
            problem[0] = str(exc)
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ConfigError(problem[0])


def _forward_sigterm(signum: int, frame: Any) -> None:
    """Launcher: pass SIGTERM on to the workers (they save and stop); before they exist, stop."""
    children = multiprocessing.active_children()
    if not children:
        _terminate_process_handler(signum, frame)  # raises: the agent shuts down as for SIGINT
    for child in children:
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass


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
        signals_to_handle=",".join(AGENT_SIGNALS),
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    handled = (signal.SIGTERM, *(getattr(signal, name) for name in AGENT_SIGNALS))
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in handled} if main else {}
    if main:
        signal.signal(signal.SIGTERM, _forward_sigterm)
    messages = tempfile.mkdtemp(prefix="shardlm-ranks-")
    quiet = _QuietCleanFailures(messages)
    for name in QUIETED:
        logging.getLogger(name).addFilter(quiet)
    try:
        return elastic_launch(config, RankEntry(fn, messages))(*args)
    except ChildFailedError as exc:
        clean = _messages(messages)
        if clean:  # a rank's own one-line answer (ConfigError): the first rank that gave one
            rank = min(clean)
            raise RankFailed(f"rank {rank} failed: {clean[rank]}") from None
        rank, failure = root_failure(exc.failures)
        raise RankFailed(f"rank {rank} failed: {describe(failure)}") from None
    finally:
        for name in QUIETED:
            logging.getLogger(name).removeFilter(quiet)
        shutil.rmtree(messages, ignore_errors=True)
        for sig, handler in previous.items():  # the agent installs its own; put the caller's back
            signal.signal(sig, handler)


def root_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The failure that caused the others: the earliest, preferring a rank killed by a signal.

    Timestamps have whole-second resolution, and a rank that loses a peer mid-collective raises
    within milliseconds, so "earliest" alone often names a survivor. A rank killed by a signal
    other than SIGTERM (which the agent sends to stop survivors) within a second of the first
    failure is taken as the cause.
    """
    first = min(f.timestamp for f in failures.values())
    killed = [
        (rank, f)
        for rank, f in failures.items()
        if f.exitcode < 0 and f.exitcode != -signal.SIGTERM and f.timestamp <= first + 1
    ]
    if killed:
        return min(killed, key=lambda item: item[1].timestamp)
    return min(failures.items(), key=lambda item: item[1].timestamp)


def describe(failure: ProcessFailure) -> str:
    """One line: ``killed by signal SIGKILL (pid N)`` or the last line of the rank's error."""
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = str(-failure.exitcode)
        return f"killed by signal {name} (pid {failure.pid})"
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    return str(message).strip().splitlines()[-1] if message else f"exit code {failure.exitcode}"


class RankFailed(RuntimeError):
    """A worker process failed; the message names the rank and its last error line."""
