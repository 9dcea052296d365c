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

from ddp_slurm import config, safefs
from ddp_slurm.config import Config
from ddp_slurm.train import checkpoint


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


class RunDirError(RuntimeError):
    """The run directory cannot be written (read-only or full file system, permissions)."""


class UsageError(RuntimeError):
    """A usage problem found once the ranks are up (run directory busy or holding another config): exit 2."""


def prepare(cfg: Config, lock: RunLock, model_keys: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0: take the run directory (refusing one whose checkpoints belong to another config, one that
    another launch holds, and files a co-tenant could have planted), write the resolved config, and return
    the checkpoint to resume from (None: fresh start).

    Only a checkpoint that loads, holds the step its name says, and matches this run (its own config,
    ``model_keys``' names and shapes, every entry a resume needs) is resumed; others are skipped with a
    warning, never deleted. A directory with a config but no checkpoint holds no work yet: it is taken
    over, so a launch that failed before its first checkpoint (missing data, a typo) locks nothing in."""
    run_dir, saved, shared = cfg.run_dir, cfg.run_dir / "config.yaml", cfg.run.shared
    accept = checkpoint.all_of(
        checkpoint.require("model", "optimizer", "scheduler", "rng", "config"),
        checkpoint.same_config(cfg),
        checkpoint.same_model(model_keys),
    )
    try:
        if run_dir.exists():
            safefs.check_run_dir(run_dir, shared)  # before anything in it is read
        if saved.exists() and checkpoint.list_checkpoints(run_dir):
            diffs = config.incompatible_changes(config.read_resolved(saved), cfg)
            if diffs:
                raise UsageError(
                    f"run directory {run_dir} holds a run with another config ({'; '.join(diffs)}): "
                    "launch with the same settings to resume it, or choose another run.name"
                )
        safefs.make_dir(run_dir, shared)
        lock.acquire()
        checkpoint.remove_stale_temporaries(run_dir)
        found = checkpoint.latest(run_dir, accept=accept, shared=shared)
        config.dump(cfg, saved)
    except RunLocked as exc:
        raise UsageError(str(exc)) from None
    except (safefs.UnsafePath, config.ConfigError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # a read-only or full file system, no permission: one line, not a traceback
        raise RunDirError(
            f"cannot write the run directory {run_dir}: {exc.strerror or exc} ({exc.filename}); "
            "make it writable or choose another run.output_root"
        ) from None
    return found
