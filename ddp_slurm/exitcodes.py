"""Exit codes of every entry point, and how one that has run torch.distributed leaves, in one place
(imports nothing heavy, so launchers stay torch-free)."""

from __future__ import annotations

import enum
import logging
import os
import sys
from typing import NoReturn


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


def exit_now(code: int) -> NoReturn:
    """Leave the process with ``code`` without interpreter finalization, once everything is flushed.

    With torch's gloo backend, finalization can meet a gloo worker thread that a DDP reducer keeps
    alive past ``destroy_process_group``; the thread is then ended under it, which aborts the whole
    process ("terminate called without an active exception", exit 134 or -6) in a few percent of
    runs that had finished cleanly, turning a completed Slurm job into a failed one. Every entry
    point that may have joined a process group leaves through here once its files are closed.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
