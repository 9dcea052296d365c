"""The two ways shard data is refused, each one line with its exit code (``ddp_slurm.errors``).

A shard that does not match its index is ``ShardError`` (exit 65, EX_DATAERR): the data changed under the
run, and no order is made of it. A folder without an index is ``ShardUsageError`` (exit 2): nothing was started,
and the message names the command that builds it; an index is never built silently inside a job.

A ``ShardError`` raised in a DataLoader worker reaches the training process re-raised by torch with the
worker's whole traceback as its message; ``ShardError`` keeps the original line only, so the log still
says it in one line.
"""

from __future__ import annotations

from typing import ClassVar

from ddp_slurm import errors
from ddp_slurm.exitcodes import EXIT_DATA

_WRAPPED = "Original Traceback"


def _one_line(message: str) -> str:
    """The error's own line out of torch's worker wrapper (``Caught ShardError in DataLoader worker ...``)."""
    if _WRAPPED not in message:
        return message
    last = [line for line in message.splitlines() if line.strip()][-1]
    return last.split("Error: ", 1)[-1] if "Error: " in last else last


class ShardError(errors.Error):
    """A shard or sample that does not match its index, or a file that is not a plain WebDataset tar: exit 65."""

    exit_code: ClassVar[int] = EXIT_DATA

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))


class ShardUsageError(errors.UsageError):
    """Shards that cannot be used as asked (no current index, a path without shards, staging without a place
    to stage to): exit 2; a missing index names the command that builds it."""
