"""Exit codes of every entry point, how one that has run torch.distributed leaves, and how a worker tells
the local launcher which code it left with, in one place (imports nothing heavy, so launchers stay
torch-free).

The worker's exit file: on SIGINT torchrun's agent raises an exception in itself, passes SIGINT on
to its workers, waits for them and then forgets how they ended; the launcher would only know
"interrupted" (exit 130), although the workers wrote a checkpoint and exited 75 ("launch again to
resume"). So the launcher names a folder in ``DDP_SLURM_EXIT_DIR`` before torchrun starts the workers
(they inherit it); each training process writes ``<pid>`` there when it starts (``started``) and
overwrites it with its exit code when it leaves (``record``). A worker killed before it could write
its code leaves ``started``. Outside the launcher the variable is unset and nothing is written. The
runtime records its code here, on its own side; the launcher (``launch/torchrun.py``) reads it.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from pathlib import Path
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
    DATA = 65
    """The training data does not match its index (a shard changed, was cut or corrupted; EX_DATAERR): the
    message names the shard and the sample; nothing after the last checkpoint was trained on it."""
    STOPPED = 75
    """Stopped cleanly on a stop signal with a checkpoint on disk (EX_TEMPFAIL): launch again to resume."""


EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_REQUEUE_CAP, EXIT_DATA, EXIT_STOPPED = (
    ExitCode.OK,
    ExitCode.FAILURE,
    ExitCode.USAGE,
    ExitCode.REQUEUE_CAP,
    ExitCode.DATA,
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


# The worker's exit file (see the module docstring).

EXIT_DIR_ENV = "DDP_SLURM_EXIT_DIR"


def _own_file() -> Path | None:
    folder = os.environ.get(EXIT_DIR_ENV)
    return Path(folder, str(os.getpid())) if folder else None


STARTED = "started"
"""What a worker's file holds until its exit code replaces it."""


def started() -> None:
    """A worker: note that this process runs (its code follows at exit)."""
    path = _own_file()
    if path is not None:
        try:
            path.write_text(STARTED)
        except OSError:  # the launcher's folder is gone: it only loses the exit-75 pass-through
            pass


def record(code: int) -> None:
    """A worker, leaving: its exit code for the launcher."""
    path = _own_file()
    if path is not None:
        try:
            path.write_text(str(int(code)))
        except OSError:
            pass


def codes(folder: Path) -> list[str]:
    """The launcher: what each worker wrote (an exit code, or ``started`` for one that did not finish)."""
    return [p.read_text().strip() for p in sorted(folder.iterdir())] if folder.is_dir() else []


def all_stopped(folder: Path, expected: int | None, stopped: int) -> bool:
    """True when every worker (``expected`` of them, where the launcher knows the count) exited ``stopped``."""
    found = codes(folder)
    return bool(found) and all(c == str(stopped) for c in found) and (expected is None or len(found) == expected)
