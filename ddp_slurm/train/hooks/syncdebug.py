"""``DDP_SLURM_SYNC_DEBUG=error`` (or ``warn``): CUDA's sync debug mode over the steady-state steps of a run
(a hook, ``SyncDebug``).

A steady-state CUDA step must never make the host wait for the device (docs/gpu.md lists the places
that may: start-up, a log line, an evaluation, a save). With this variable set, the training loop
switches ``torch.cuda.set_sync_debug_mode`` on from the ``WARMUP_STEPS``-th step of a launch (the first
steps allocate and set up) and off around each boundary, so that ``error`` turns any synchronising
call inside a steady step into an exception naming it (tests/test_gpu_path.py runs the real loop so).
The number of steps it watched is logged at the end, so a check can tell that it was on at all.
Without CUDA, or unset, it does nothing. A value other than ``warn`` or ``error`` is refused at start-up
with the config's checks (``mode_from``, called by ``train.entry``: exit 2 before the run directory
exists), on CPU too.

Torch's mode always follows the watch's flag (``SyncWatch._apply``): on while the watch is on and not
paused, off otherwise. The guard's rollback and verdict (train/guard/) wait for the device (a checkpoint
loaded, the traces read) at a step that is not a boundary: they run inside ``paused``, which sets the mode
aside and puts it back as the flag says; a rollback's ``start`` begins a new warm-up with the watch off,
both flag and mode, so that the next log line does not run under "error" with the flag saying off.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ddp_slurm.train.hooks.base import Hook, Training
from ddp_slurm.train.syncmode import ENV, MODES, mode_from  # noqa: F401  (this hook's variable)

log = logging.getLogger("ddp_slurm")

WARMUP_STEPS = 3  # steps of each launch before the watch starts: first allocations, cuDNN's choices


class SyncWatch:
    """Switches the sync debug mode on for steady steps and off at boundaries; counts the steps watched."""

    def __init__(self, mode: str | None, first_step: int) -> None:
        mode = mode_from({ENV: mode} if mode else {})
        self.mode, self.start, self.watched, self.on, self.pauses = mode, first_step + WARMUP_STEPS, 0, False, 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], device: torch.device, first_step: int) -> SyncWatch:
        mode = mode_from(environ)
        return cls(mode if device.type == "cuda" else None, first_step)

    def _apply(self) -> None:
        """Torch's mode as the flag says: the mode while on and not paused, else off."""
        if self.mode is not None:
            torch.cuda.set_sync_debug_mode(self.mode if self.on and not self.pauses else 0)

    def steady(self, step: int) -> None:
        """Before the step that follows ``step``: watch it, once warmed up."""
        if self.mode is None or step < self.start:
            return
        if not self.on:
            self.on = True
            self._apply()
        self.watched += 1

    def boundary(self) -> None:
        """Before a log line, a save, an evaluation or the end: these may wait for the device."""
        if self.on:
            self.on = False
            self._apply()

    def restart(self, first_step: int) -> None:
        """A new warm-up from ``first_step`` (a launch, or the step a rollback went back to): off until then."""
        self.boundary()
        self.start = first_step + WARMUP_STEPS

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Off inside (the host may wait for the device there), then as the flag says: back on if the
        watch still is, off if a boundary or a restart came inside."""
        self.pauses += 1
        if self.on and self.pauses == 1:
            self._apply()
        try:
            yield
        finally:
            self.pauses -= 1
            if self.on and not self.pauses:
                self._apply()

    def close(self) -> None:
        self.boundary()
        if self.mode is not None:
            log.info("%s=%s: %d steady steps ran without a host sync", ENV, self.mode, self.watched)


def reset(device: torch.device) -> None:
    """Leaving training on an error: the cleanup that follows may wait for the device."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(0)


class SyncDebug(Hook):
    """The watch as a hook: steady before each step, off at each boundary and at the end."""

    def __init__(self, run: Any) -> None:
        self.watch = SyncWatch.from_environ(os.environ, run.device, run.pos.step)

    def start(self, t: Training) -> None:
        self.watch.restart(t.run.pos.step)  # counted from the step resumed at, or gone back to

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.watch.paused()

    def before_step(self, t: Training) -> None:
        self.watch.steady(t.run.pos.step)

    def boundary(self, t: Training) -> None:
        self.watch.boundary()

    def epoch_end(self, t: Training) -> None:
        self.watch.boundary()  # the evaluation that follows may wait for the device

    def end(self, t: Training) -> None:
        self.watch.close()


def paused(hooks: Any) -> contextlib.AbstractContextManager[None]:
    """The watch among ``hooks`` (a ``Hooks``) set aside while the host waits for the device at a step that
    is not a boundary (the guard's rollback and verdict); nothing without one."""
    hook = next((h for h in getattr(hooks, "hooks", []) if isinstance(h, SyncDebug)), None)
    return hook.paused() if hook is not None else contextlib.nullcontext()
