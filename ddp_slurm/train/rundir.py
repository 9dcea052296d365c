"""The run directory: taken by one launch at a time, its config written, its checkpoint found.

One launch per run directory: an ``flock`` on ``<run_dir>/.lock`` held by rank 0.

The kernel drops an flock when its process dies, so a crashed or killed run never leaves the
directory stuck; the pid and host written into the file are only there for the error message.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import Any

from ddp_slurm import config
from ddp_slurm.config import Config
from ddp_slurm.train import checkpoint


class RunLocked(RuntimeError):
    """Another live launch holds the run directory."""


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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


class RunDirError(RuntimeError):
    """The run directory cannot be written (read-only or full file system, permissions)."""


class UsageError(RuntimeError):
    """A usage problem found once the ranks are up (run directory busy or holding another config): exit 2."""


def prepare(cfg: Config, lock: RunLock) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0: take the run directory (refusing one whose checkpoints belong to another config, or that
    another launch holds), write the resolved config, and return the checkpoint to resume from (None:
    fresh start). A directory with a config but no checkpoint holds no work yet: it is taken over, so a
    launch that failed before its first checkpoint (missing data, a typo) never locks its settings in."""
    run_dir, saved = cfg.run_dir, cfg.run_dir / "config.yaml"
    if saved.exists() and checkpoint.list_checkpoints(run_dir):
        diffs = config.incompatible_changes(config.read_resolved(saved), cfg)
        if diffs:
            raise UsageError(
                f"run directory {run_dir} holds a run with another config ({'; '.join(diffs)}): "
                "launch with the same settings to resume it, or choose another run.name"
            )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        checkpoint.remove_stale_temporaries(run_dir)
        found = checkpoint.latest(run_dir)
        config.dump(cfg, saved)
    except RunLocked as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # a read-only or full file system, no permission: one line, not a traceback
        raise RunDirError(
            f"cannot write the run directory {run_dir}: {exc.strerror or exc} ({exc.filename}); "
            "make it writable or choose another run.output_root"
        ) from None
    return found
