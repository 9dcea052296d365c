"""Errors whose one-line message says it all, each carrying the exit code it ends a command with.

One hierarchy for the whole package: every error that ends a command is an ``Error`` and knows its
exit code, so an entry point catches ``Error`` once, logs the message as one line (no traceback) and
exits with ``exit_code``; nothing converts one error type into another on the way. The three codes:

- ``Error``: a failure the message explains (exit 1): a rendezvous that failed, a lost rank, a
  checkpoint that cannot be written, a loss that became NaN;
- ``UsageError``: nothing was started and nothing lost (exit 2): a bad option or config value, a run
  directory another launch holds or another user could have written, checkpoints none of which fits;
- ``Stopped``: a stop signal came before anything started (exit 75: launch again).

A task raises its own subclass (``class DataError(errors.UsageError)``: missing data, say) and the
runtime reports it the same way, so the runtime never imports a task to know its errors. What stays
outside: exceptions that never leave their module (a seal that does not match, a cancelled write, a
checkpoint skipped for a reason), each caught where it is raised. Torch-free: the launchers import it.
"""

from __future__ import annotations

from typing import ClassVar

from ddp_slurm.exitcodes import EXIT_FAILURE, EXIT_STOPPED, EXIT_USAGE


class Error(Exception):
    """A failure the message explains (what went wrong and what to do): exit ``exit_code``, one line."""

    exit_code: ClassVar[int] = EXIT_FAILURE


class UsageError(Error):
    """A usage problem (a bad option, a run directory holding another config, one another launch
    holds): nothing was started, nothing lost; exit 2."""

    exit_code: ClassVar[int] = EXIT_USAGE


class Stopped(Error):
    """A stop signal before anything started (the ranks were still meeting): nothing to save; exit 75."""

    exit_code: ClassVar[int] = EXIT_STOPPED
