"""One launch per run directory: an ``flock`` on ``<run_dir>/.lock`` held by rank 0.

The kernel drops an flock when its process dies, so a crashed or killed run never leaves the
directory stuck; the pid and host written into the file are only there for the error message.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from ddp_slurm import safefs


class RunLocked(RuntimeError):
    """Another live launch holds the run directory."""


class RunLock:
    def __init__(self, run_dir: Path, shared: bool = False) -> None:
        self.path = Path(run_dir) / ".lock"
        self.shared = shared  # run.shared: a teammate's lock file is fine
        self._fd: int | None = None

    def acquire(self) -> None:
        """Raises RunLocked, or safefs.UnsafePath when ``.lock`` is a symlink, FIFO or another user's file
        (it is never followed or written through)."""
        fd = safefs.open_owned(self.path, os.O_RDWR, self.shared)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
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
            os.close(self._fd)  # closing drops the flock; the file stays (harmless, reused next time)
            self._fd = None
