"""The run directory: taken by one launch at a time, checked before anything in it is read, its config written.

One launch per run directory: a POSIX lock (``lockf``) on ``<run_dir>/.lock`` held by rank 0.

The kernel drops the lock when its process dies, so a crashed or killed run never leaves the
directory stuck; the pid and host written into the file are only there for the error message. A
POSIX lock, not an ``flock``: an flock belongs to the open file, which DataLoader worker processes
inherit when they fork, so a worker outliving its rank (it notices only seconds later) would hold the
run directory against the relaunch; a POSIX lock belongs to the process that took it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import Any

from ddp_slurm import config, errors, safefs
from ddp_slurm.config import Config
from ddp_slurm.errors import UsageError  # a usage problem found once the ranks are up: exit 2
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import Checkpointer


class RunLocked(UsageError):
    """Another live launch holds the run directory."""


class RunLock:
    def __init__(self, paths: RunPaths) -> None:
        self.path = paths.lock
        self.shared = paths.shared  # run.shared: a teammate's lock file is fine
        self._fd: int | None = None

    def acquire(self) -> None:
        """Raises RunLocked, or safefs.UnsafePath when ``.lock`` is a symlink, FIFO or another user's file
        (it is never followed or written through)."""
        fd = safefs.open_owned(self.path, os.O_RDWR, self.shared)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(
                f"run directory {self.path.parent} is in use by another launch ({holder}); "
                "wait for it to finish, or stop it, or choose another run.name"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock; the file stays (harmless, reused next time)
            self._fd = None


class RunDirError(errors.Error):
    """The run directory cannot be written (read-only or full file system, permissions)."""


def take(cfg: Config, lock: RunLock, ckpt: Checkpointer) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0: take the run directory and return the checkpoint to resume from (None: a fresh start).

    Refuses (exit 2, one line, nothing changed) a run directory someone else could have written, one that
    another launch holds, one whose checkpoints another strategy wrote, and one whose config a resume of
    this run cannot take. Then writes the resolved config. Which checkpoint is resumed is the
    checkpointer's (through the gate: trusted, whole, this run's, fitting); one that is not is skipped
    with a warning, never deleted. A directory with a config but no checkpoint holds no work yet: it is
    taken over, so a launch that failed before its first checkpoint (missing data, a typo) locks nothing in."""
    run_dir, saved, shared = cfg.run_dir, cfg.paths.config, cfg.paths.shared
    try:
        if run_dir.exists():
            safefs.check_run_dir(run_dir, shared)  # before anything in it is read
        conflict = ckpt.conflict()
        if conflict:
            raise UsageError(conflict)
        if saved.exists() and ckpt.has_checkpoints():
            diffs = config.changes_from(config.read_saved(saved), cfg, str(saved))
            if diffs:
                raise UsageError(config.changed_config(run_dir, diffs))
        safefs.make_dir(run_dir, shared)
        if os.path.lexists(cfg.paths.metrics):  # reopened by rank 0 later: a planted one is refused now, in one line
            os.close(safefs.open_owned(cfg.paths.metrics, os.O_WRONLY | os.O_APPEND, shared))
        lock.acquire()
        found = ckpt.find()
        config.dump(cfg, saved)
    except OSError as exc:  # a read-only or full file system, no permission: one line, not a traceback
        raise RunDirError(
            f"cannot write the run directory {run_dir}: {exc.strerror or exc} ({exc.filename}); "
            "make it writable or choose another run.output_root"
        ) from None
    return found
