"""Exit codes of every entry point, in one place (imports nothing, so launchers stay torch-free)."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    """Finished (or already finished: nothing to do)."""
    FAILURE = 1
    """Any other failure; the log says why."""
    USAGE = 2
    """Usage or config error: nothing was started, nothing created."""
    REQUEUE_CAP = 3
    """``slurm.max_requeues`` reached: not requeued again."""
    STOPPED = 75
    """Stopped cleanly on a stop signal with a checkpoint on disk (EX_TEMPFAIL): launch again to resume."""


EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_REQUEUE_CAP, EXIT_STOPPED = (
    ExitCode.OK,
    ExitCode.FAILURE,
    ExitCode.USAGE,
    ExitCode.REQUEUE_CAP,
    ExitCode.STOPPED,
)
