"""Surviving faults: preemption (SIGTERM), non-finite steps; the trainer calls in here in a few lines.

Preemption. ``SIGTERM`` only sets a flag (a Python handler may run between any two bytecodes,
including while this rank's peers wait for it in a collective, so it must not save or exit
itself). Every optimizer step, just before the update, one all-reduce (MAX over the world)
combines each rank's "signalled" flag with its "non-finite" flag (``StepGuard.check``): all
ranks learn in the same step that some rank was signalled, finish that step, save the same
checkpoint and return normally (exit code 0). A signal to one worker, to every worker, or to
the launcher (``distributed/launch.py`` forwards it to the workers) ends the same way. Under ``run`` (the
CLI) a signal that comes while the model is built is kept and acted on after the first step.
Ctrl-C (SIGINT) still stops at once, without saving. When a rank dies, the SIGTERM with which
the launcher stops the survivors only sets the flag too: they fail at their next collective,
which lost a peer (measured: within 0.1 s on gloo), or are SIGKILLed 30 s later.

Non-finite steps. If the loss or the gradient norm of a step is inf or NaN on any rank, no rank
applies the update: the optimizer does not step, gradients are zeroed, the step's batch is
consumed (retrying it would fail the same way) and the LR scheduler still steps, so the learning
rate stays a function of the step number like the data order. The record of that step is logged
with ``skipped: true``. After ``train.max_bad_steps`` bad steps in a row training stops with
``NonFiniteError``; the weights are still those of the last good step. The loss (all-reduced over
dp) and the gradient norm (all-reduced over the world) are already global, and the flags are
all-reduced once more, so every rank takes the same decision.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("shardlm")

_received: str | None = None  # name of the stop signal this process received, until acted on


class NonFiniteError(RuntimeError):
    """``train.max_bad_steps`` steps in a row had a non-finite loss or gradient norm."""


def _on_sigterm(signum: int, frame: object) -> None:
    global _received
    _received = signal.Signals(signum).name


def catch_sigterm() -> Any:
    """From now on SIGTERM in this process asks for a checkpoint and a clean stop (main thread only).

    ``run`` calls this first thing, so a signal that arrives while the model is being built is
    neither lost nor fatal; ``Trainer.train`` calls it too and puts the previous handler back at
    the end (``restore_sigterm``). Returns the previous handler (None off the main thread).
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def restore_sigterm(previous: Any) -> None:
    """Put back the SIGTERM handler ``catch_sigterm`` replaced."""
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def stop_received() -> str | None:
    """The stop signal this process received and has not acted on yet (a name like ``SIGTERM``)."""
    return _received


class StepGuard:
    """Per-step decisions shared by every rank: skip a non-finite update, stop on a signal."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.bad_in_a_row = 0
        self.stop = False  # some rank was signalled: finish this step, save, return

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int) -> bool:
        """Collective (one all-reduce over the world). True if this step's update must be skipped."""
        finite = bool(torch.isfinite(loss).all()) and bool(torch.isfinite(grad_norm).all())
        flags = torch.tensor([float(not finite), float(_received is not None)], device=loss.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, self.stop = bool(flags[0] > 0), bool(flags[1] > 0)
        if not bad:
            self.bad_in_a_row = 0
            return False
        self.bad_in_a_row += 1
        what = f"loss {float(loss):.4g}, grad_norm {float(grad_norm):.4g}"
        log.warning("step %d: non-finite (%s on some rank); update skipped", step, what)
        if dist.get_rank() == 0:
            print(
                f"step {step}: non-finite loss or gradient norm ({what}); update skipped "
                f"({self.bad_in_a_row} in a row, train.max_bad_steps={self.max_bad_steps})",
                flush=True,
            )
        return True

    def raise_if_too_many(self, step: int) -> None:
        """After the step is logged: stop training once ``max_bad_steps`` bad steps came in a row."""
        if self.bad_in_a_row >= self.max_bad_steps:
            raise NonFiniteError(
                f"step {step}: {self.bad_in_a_row} steps in a row had a non-finite loss or gradient norm "
                f"(train.max_bad_steps={self.max_bad_steps}); their updates were skipped, the weights are those "
                f"of step {step - self.bad_in_a_row}: lower train.learning_rate, set max_grad_norm, or check the data"
            )


def stop_for_signal(step: int, path: str) -> str:
    """Every rank, after the step at which the ranks agreed to stop and saved ``path``: tell the user.

    Returns the checkpoint directory.
    """
    global _received
    _received = None
    log.info("stopping at step %d for SIGTERM; checkpoint %s", step, path)
    if dist.get_rank() == 0:
        print(f"received SIGTERM: saved {path} at step {step}, exiting; resume with train.resume=true", flush=True)
    return path
