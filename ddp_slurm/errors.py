"""Errors whose one-line message says it all, each carrying the exit code it ends a command with.

The runtime catches ``Error`` (never a task's class by name): the entry point logs the message as one
line, without a traceback, and exits with the error's ``exit_code``. A task raises its own subclass
(``class DataError(errors.Error)``: missing data, say) and the runtime reports it the same way, so the
runtime never imports a task to know its errors. Torch-free: the launchers import it.
"""

from __future__ import annotations

from typing import ClassVar

from ddp_slurm.exitcodes import EXIT_FAILURE, EXIT_USAGE


class Error(Exception):
    """A failure the message explains (what went wrong and what to do): exit ``exit_code``, one line."""

    exit_code: ClassVar[int] = EXIT_FAILURE


class UsageError(Error):
    """A usage problem (a bad option, a run directory holding another config, one another launch
    holds): nothing was started, nothing lost; exit 2."""

    exit_code: ClassVar[int] = EXIT_USAGE
