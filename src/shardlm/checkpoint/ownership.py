"""Who owns an output directory: one live run at a time, and a fresh run never buries an earlier one.

``shardlm train`` takes ``OUTPUT_DIR/.shardlm.lock`` before spawning and removes it when the run
ends (``OutputDirLock``). The lock holds the owner's pid, host, start time, the pid's kernel start
time (so a reused pid is not taken for the owner) and the run id. A second run on the same
directory while the owner lives is refused with one line naming it. A lock whose process is gone
(same host) is reported and taken over; a lock from another host cannot be checked and is
refused, with the fix (remove the file if that run is dead). Creating the lock is atomic: the
file is written whole under a private name, then hard-linked to ``.shardlm.lock``, which fails
if it exists; a stale lock is first renamed away and read back, so that of two runs taking over
the same dead owner's lock only one keeps it.

A run that does not resume from a checkpoint of this directory (``train.resume`` unset, or
naming another directory's checkpoint, or ``true`` with no checkpoint here) into a directory
holding another run's checkpoints or metrics is refused (``claim``), unless
``train.overwrite_output_dir: true`` (the name of Hugging Face's ``TrainingArguments``): then the
files the earlier run wrote are removed, saying which, and nothing else (``earlier_files``).
Every run has an id (``SHARDLM_RUN_ID``, set by the CLI, inherited by the spawned ranks);
metrics.jsonl records and rank log lines carry it, and a resumed run appends to both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass

import torch.distributed as dist

from shardlm.checkpoint.layout import STEP_DIR, checkpoints_dir
from shardlm.errors import ConfigError

LOCK = ".shardlm.lock"
RUN_ID_ENV = "SHARDLM_RUN_ID"
RANK_LOG = re.compile(r"^rank\d+\.log$")  # train/metrics.py's per-rank logs
TB_EVENTS = re.compile(r"^events\.out\.tfevents\.")  # what TensorBoard's SummaryWriter writes


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
            os.rename(self.path, stale)
        except FileNotFoundError:
            return
        if read_owner(stale) != other:  # a racing run took the dead owner's lock first: give it back
            try:
                os.link(stale, self.path)
            except FileExistsError:
                pass
            os.remove(stale)
            return
        os.remove(stale)
        print(f"warning: {where}: taking over the lock of {other.describe()}, whose process is gone", flush=True)

    def __exit__(self, *exc) -> None:
        if self.held:
            owner = read_owner(self.path)
            if owner is not None and owner.run_id == self.me.run_id:
                os.remove(self.path)
            self.held = False


def earlier_files(output_dir: str) -> list[str]:
    """The files and directories a shardlm run writes in ``output_dir``, as they are there now:
    complete and interrupted ``checkpoints/step-N`` saves, ``metrics.jsonl``, ``loss.png``, rank logs,
    TensorBoard event files. Nothing else in ``output_dir`` is a run's, so nothing else is removed."""
    found = []
    root = checkpoints_dir(output_dir)
    if os.path.isdir(root) and not os.path.islink(root):
        found += [os.path.join(root, n) for n in sorted(os.listdir(root)) if STEP_DIR.match(n.split(".", 1)[0])]
    found += [p for p in (os.path.join(output_dir, n) for n in ("metrics.jsonl", "loss.png")) if os.path.isfile(p)]
    for sub, pattern in (("logs", RANK_LOG), ("tensorboard", TB_EVENTS)):
        folder = os.path.join(output_dir, sub)
        if os.path.isdir(folder) and not os.path.islink(folder):
            found += [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if pattern.match(n)]
    return found


def earlier_outputs(output_dir: str) -> list[str]:
    """What an earlier run left in ``output_dir``: its checkpoints (any step directory) and metrics."""
    found = []
    root = checkpoints_dir(output_dir)
    steps = sorted(n for n in os.listdir(root) if STEP_DIR.match(n.split(".", 1)[0])) if os.path.isdir(root) else []
    if steps:
        found.append(f"checkpoints ({', '.join(steps[:3])}{', ...' if len(steps) > 3 else ''})")
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    return found


def claim(output_dir: str, resume_from: str | None, overwrite: bool) -> None:
    """The lock holder, before spawning: refuse to start fresh over an earlier run's outputs, or
    remove them under ``train.overwrite_output_dir``, saying so. ``resume_from``: the checkpoint
    this run resumes (``preflight.check_run``); only one of this directory continues its run."""
    mine = os.path.realpath(checkpoints_dir(output_dir)) + os.sep
    if resume_from is not None and os.path.realpath(resume_from).startswith(mine):
        return
    found = earlier_outputs(output_dir)
    if not found:
        return
    if not overwrite:
        raise ConfigError(
            f"train.output_dir: '{output_dir}' holds another run's {' and '.join(found)}; set train.resume=true "
            "to continue it, train.overwrite_output_dir=true to replace it, or choose another output_dir"
        )
    removed = earlier_files(output_dir)
    for path in removed:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    for sub in ("checkpoints", "logs", "tensorboard"):  # the run's folders, when nothing else is in them
        folder = os.path.join(output_dir, sub)
        if os.path.isdir(folder) and not os.path.islink(folder) and not os.listdir(folder):
            os.rmdir(folder)
    names = sorted({os.path.relpath(p, output_dir).split(os.sep)[0] for p in removed})
    print(f"train.overwrite_output_dir: removed the earlier run's {', '.join(names)} from {output_dir}", flush=True)
