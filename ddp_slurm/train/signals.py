"""Stop signals as a flag: handlers record which signal came and do nothing else.

No I/O, no collective, no exception from inside a handler: the training loop reads the flag after
each step and all ranks agree (``engine.StopVote``: one small all-reduce, read a step later) on
stopping at the same step.
SIGTERM always means "checkpoint and stop"; the configured signal (SIGUSR2 by default, the one
Slurm's ``--signal`` sends before the time limit) additionally means "requeue me".

Once the ranks have agreed to stop (or have finished), the loop sets ``stopping`` and the entry
point's ``close()`` ignores the stop signals for the rest of the process's life instead of restoring
the defaults: torchrun's agent sends SIGTERM to the remaining workers as soon as one of them has
exited 75, and that second signal must not turn a clean, checkpointed stop (or a finished run) into
death by signal while the rank is still shutting down. It has to be SIG_IGN: Python's own shutdown
(seconds, with torch loaded) resets every Python-level handler to the default first, but leaves
ignored signals ignored.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType


def parse_signal(name: str) -> signal.Signals:
    """``"USR2"``, ``"SIGUSR2"`` or ``"12"`` -> ``signal.SIGUSR2``."""
    text = name.strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    return signal.Signals[text if text.startswith("SIG") else "SIG" + text]


class StopFlag:
    """Installs handlers for ``requeue_signal`` and SIGTERM; ``restore()`` puts the old ones back,
    ``close()`` (entry points) restores them or, once ``stopping``, ignores further stop signals."""

    def __init__(self, requeue_signal: signal.Signals = signal.SIGUSR2) -> None:
        self.requeue_signal = requeue_signal
        self.requeue_requested = False  # the configured signal arrived (time limit / manual stop)
        self.terminate_requested = False  # SIGTERM arrived (preemption, scancel, torchrun shutting down)
        self.stopping = False  # set by the loop once every rank agreed to stop (or finished): see close()
        self._previous: dict[int, Callable | int | None] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM:
            self.terminate_requested = True
        else:
            self.requeue_requested = True

    @property
    def requested(self) -> bool:
        return self.requeue_requested or self.terminate_requested

    def install(self) -> StopFlag:
        for sig in {self.requeue_signal, signal.SIGTERM}:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def close(self) -> None:
        """For the entry point, as it returns: ``restore()``, or, when ``stopping``, ignore the stop
        signals until the process exits (see the module docstring)."""
        if not self.stopping:
            self.restore()
            return
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)
        self._previous.clear()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
