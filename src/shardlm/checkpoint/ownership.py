"""Who owns an output directory: one live run at a time, and a fresh run never buries an earlier one.

``shardlm train`` takes ``OUTPUT_DIR/.shardlm.lock`` before spawning and removes it when the run
ends (``OutputDirLock``). The lock holds the owner's pid, host, start time, the pid's kernel start
time (so a reused pid is not taken for the owner) and the run id. A second run on the same
directory while the owner lives is refused with one line naming it. A lock whose process is gone
(same host) is reported and taken over; a lock from another host cannot be checked and is
refused, with the fix (remove the file if that run is dead). Creating the lock is atomic: the
file is written whole under a private name, then hard-linked to ``.shardlm.lock``, which fails
if it exists; a stale lock is first renamed away, which only one of two racing runs can do.

A run that does not resume (``train.resume`` unset) into a directory holding another run's
checkpoints or metrics is refused (``claim``), unless ``train.overwrite_output_dir: true`` (the
name of Hugging Face's ``TrainingArguments``): then the earlier run's outputs are removed, saying
which. Every run has an id (``SHARDLM_RUN_ID``, set by the CLI, inherited by the spawned ranks);
metrics.jsonl records and rank log lines carry it, and a resumed run appends to both.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass

import torch.distributed as dist

from shardlm.checkpoint.layout import checkpoints_dir
from shardlm.errors import ConfigError

LOCK = ".shardlm.lock"
RUN_ID_ENV = "SHARDLM_RUN_ID"
OUTPUTS = ("checkpoints", "metrics.jsonl", "loss.png", "tensorboard", "logs")  # what overwrite_output_dir removes


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def run_id() -> str:
    """A new run's id: the CLI's (``SHARDLM_RUN_ID``), or one rank 0 makes and broadcasts (collective)."""
    if os.environ.get(RUN_ID_ENV):
        return os.environ[RUN_ID_ENV]
    box = [new_run_id() if not dist.is_initialized() or dist.get_rank() == 0 else ""]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat), None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class Owner:
    pid: int
    host: str
    started: str
    run_id: str
    pid_start: str | None = None

    def describe(self) -> str:
        return f"run {self.run_id} (pid {self.pid} on host {self.host}, started {self.started})"

    def alive(self) -> bool | None:
        """True or False on this host; None on another host (cannot be checked from here)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # a process of another user: alive
        return self.pid_start is None or _proc_start(self.pid) in (None, self.pid_start)


def read_owner(path: str) -> Owner | None:
    try:
        with open(path) as fh:
            return Owner(**json.load(fh))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        raise ConfigError(
            f"train.output_dir: lock file '{path}' is unreadable; if no run uses this directory, remove it"
        ) from None


class OutputDirLock:
    """``with OutputDirLock(output_dir, run_id):`` the run owns ``output_dir`` (see the module docstring)."""

    def __init__(self, output_dir: str, run_id: str):
        self.path = os.path.join(output_dir, LOCK)
        self.me = Owner(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%dT%H:%M:%S%z"), run_id)
        self.me.pid_start = _proc_start(self.me.pid)
        self.held = False

    def __enter__(self) -> OutputDirLock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        mine = f"{self.path}.{self.me.run_id}"
        with open(mine, "w") as fh:
            json.dump(asdict(self.me), fh)
        try:
            for _ in range(5):  # a racing run may take over or release a lock between the steps
                try:
                    os.link(mine, self.path)  # atomic: fails if a lock exists
                    self.held = True
                    return self
                except FileExistsError:
                    self._handle_existing()
            raise ConfigError(f"train.output_dir: could not take '{self.path}': other runs keep taking it")
        finally:
            os.remove(mine)

    def _handle_existing(self) -> None:
        other = read_owner(self.path)
        if other is None:
            return  # released meanwhile: try again
        alive = other.alive()
        where = os.path.dirname(self.path)
        if alive:
            raise ConfigError(
                f"train.output_dir: '{where}' is in use by {other.describe()}; wait for it to end or choose "
                "another output_dir"
            )
        if alive is None:
            raise ConfigError(
                f"train.output_dir: '{where}' is locked by {other.describe()}, which cannot be checked from "
                f"{socket.gethostname()}; if that run is dead, remove '{self.path}'"
            )
        stale = f"{self.path}.stale-{self.me.run_id}"
        try:
            os.rename(self.path, stale)  # only one racing run wins this
        except FileNotFoundError:
            return
        os.remove(stale)
        print(f"warning: {where}: taking over the lock of {other.describe()}, whose process is gone", flush=True)

    def __exit__(self, *exc) -> None:
        if self.held:
            owner = read_owner(self.path)
            if owner is not None and owner.run_id == self.me.run_id:
                os.remove(self.path)
            self.held = False


def earlier_outputs(output_dir: str) -> list[str]:
    """What an earlier run left in ``output_dir``: its checkpoints (any step directory) and metrics."""
    found = []
    root = checkpoints_dir(output_dir)
    steps = sorted(n for n in os.listdir(root) if n.startswith("step-")) if os.path.isdir(root) else []
    if steps:
        found.append(f"checkpoints ({', '.join(steps[:3])}{', ...' if len(steps) > 3 else ''})")
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    return found


def claim(output_dir: str, resume: bool | str | None, overwrite: bool) -> None:
    """The lock holder, before spawning: refuse to start fresh over an earlier run's outputs, or
    remove them under ``train.overwrite_output_dir``, saying so."""
    if resume:
        return
    found = earlier_outputs(output_dir)
    if not found:
        return
    if not overwrite:
        raise ConfigError(
            f"train.output_dir: '{output_dir}' holds another run's {' and '.join(found)}; set train.resume=true "
            "to continue it, train.overwrite_output_dir=true to replace it, or choose another output_dir"
        )
    removed = []
    for name in OUTPUTS:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        else:
            continue
        removed.append(name)
    print(f"train.overwrite_output_dir: removed the earlier run's {', '.join(removed)} from {output_dir}", flush=True)
