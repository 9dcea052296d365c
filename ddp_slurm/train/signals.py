"""Stop signals as a flag: handlers record which signal came and do nothing else.

No I/O, no collective, no exception from inside a handler: the training loop reads the flag after
each step and all ranks agree (``vote.StopVote``: one small all-reduce, read a step later) on
stopping at the same step.
SIGTERM, SIGINT (Ctrl-C) and SIGHUP (a closed login shell) always mean "checkpoint and stop"; the
configured signal (SIGUSR2 by default, the one Slurm's ``--signal`` sends before the time limit)
additionally means "requeue me". The entry points install the flag as their first instruction
(``StopFlag.early()``, before torch is imported), so no stop signal kills a rank while it starts.

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


# Signals that always mean "checkpoint and stop, no requeue": preemption, scancel, torchrun shutting the
# workers down (TERM), Ctrl-C (INT), a closed login shell or terminal (HUP).
TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Before the config is read, which signal is the requeue one is unknown: any of those Slurm's --signal is
# usually given counts, so that none of them kills the process while torch is still importing.
EARLY_REQUEUE = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGURG)


class StopFlag:
    """Installs handlers for ``requeue_signal`` and the TERMINATING signals; ``restore()`` puts the old
    ones back, ``close()`` (entry points) restores them or, once ``stopping``, ignores further stop
    signals.

    ``StopFlag.early()`` is the entry points' first instruction: before the config says which signal
    requeues, it takes every candidate; ``configure(requeue_signal)`` narrows it once the config is
    read, re-reading what already arrived, so a signal during start-up is never lost.
    """

    def __init__(self, requeue_signal: signal.Signals = signal.SIGUSR2) -> None:
        self.requeue_signals: tuple[signal.Signals, ...] = (requeue_signal,)
        self.requeue_requested = False  # the configured signal arrived (time limit / manual stop)
        self.terminate_requested = False  # TERM, INT or HUP arrived (preemption, scancel, Ctrl-C, hang-up)
        self.stopping = False  # set by the loop once every rank agreed to stop (or finished): see close()
        self.received: list[int] = []  # every stop signal so far, in order (configure() re-reads them)
        self._previous: dict[int, Callable | int | None] = {}

    @classmethod
    def early(cls) -> StopFlag:
        """Installed at once for every signal that may mean stop (see EARLY_REQUEUE)."""
        flag = cls()
        flag.requeue_signals = EARLY_REQUEUE
        return flag.install()

    @property
    def requeue_signal(self) -> signal.Signals:
        return self.requeue_signals[0]

    def _classify(self, signum: int) -> None:
        if signum in self.requeue_signals and signum != signal.SIGTERM:
            self.requeue_requested = True
        else:
            self.terminate_requested = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)  # list.append is atomic; a handler does nothing else (no I/O)
        self._classify(signum)

    @property
    def requested(self) -> bool:
        return self.requeue_requested or self.terminate_requested

    def install(self) -> StopFlag:
        for sig in {*self.requeue_signals, *TERMINATING}:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def configure(self, requeue_signal: signal.Signals) -> None:
        """The config's ``slurm.signal`` is now known: only it requeues. Handlers stay installed for the
        signals taken early (a late one still stops cleanly instead of killing); what already arrived is
        classified again."""
        self.requeue_signals = (requeue_signal,)
        if self._previous and requeue_signal not in self._previous:
            self._previous[requeue_signal] = signal.signal(requeue_signal, self._handle)
        self.requeue_requested = self.terminate_requested = False
        for signum in list(self.received):
            self._classify(signum)

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
