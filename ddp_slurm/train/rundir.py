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
from ddp_slurm.errors import UsageError  # a usage problem found once the ranks are up: exit 2
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train import checkpoint
from ddp_slurm.train.checkpoint import fit
from ddp_slurm.train.checkpoint import sharded as ckpt_sharded


class RunLocked(RuntimeError):
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


def prepare(
    cfg: Config, lock: RunLock, model_keys: dict[str, Any], run_fit: fit.Template | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0: take the run directory (refusing one whose checkpoints belong to another config, one that
    another launch holds, and files a co-tenant could have planted), write the resolved config, and return
    the checkpoint to resume from (None: fresh start).

    Only a checkpoint that loads, holds the step its name says, and matches this run (its own config,
    ``model_keys``' names and shapes, every entry a resume needs) is resumed; others are skipped with a
    warning, never deleted. A directory with a config but no checkpoint holds no work yet: it is taken
    over, so a launch that failed before its first checkpoint (missing data, a typo) locks nothing in."""
    run_dir, saved, shared = cfg.run_dir, cfg.paths.config, cfg.paths.shared
    sharded = cfg.dist.strategy == "fsdp"  # checkpoints are folders of shards (checkpoint/sharded.py)
    accept = checkpoint.all_of(
        checkpoint.require(*(("model_shapes",) if sharded else ("model", "optimizer")), "scheduler", "rng", "config"),
        checkpoint.same_config(cfg),
        checkpoint.same_model(model_keys),
        *([fit.fits(run_fit)] if run_fit is not None else []),  # optimizer, schedule, position, RNG
    )
    try:
        if run_dir.exists():
            safefs.check_run_dir(run_dir, shared)  # before anything in it is read
        conflict = ckpt_sharded.strategy_conflict(run_dir, cfg.dist.strategy)
        if conflict:
            raise UsageError(conflict)
        if saved.exists() and (checkpoint.list_checkpoints(run_dir) or ckpt_sharded.list_sharded(run_dir)):
            diffs = config.incompatible_changes(config.read_resolved(saved), cfg)
            if diffs:
                raise UsageError(config.changed_config(run_dir, diffs))
        safefs.make_dir(run_dir, shared)
        if os.path.lexists(cfg.paths.metrics):  # reopened by rank 0 later: a planted one is refused now, in one line
            os.close(safefs.open_owned(cfg.paths.metrics, os.O_WRONLY | os.O_APPEND, shared))
        lock.acquire()
        checkpoint.remove_stale_temporaries(run_dir)
        ckpt_sharded.remove_stale_partials(run_dir)
        found = (ckpt_sharded.latest if sharded else checkpoint.latest)(run_dir, accept=accept, shared=shared)
        config.dump(cfg, saved)
    except (RunLocked, checkpoint.NoneFits) as exc:
        raise UsageError(str(exc)) from None
    except (safefs.UnsafePath, config.ConfigError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # a read-only or full file system, no permission: one line, not a traceback
        raise RunDirError(
            f"cannot write the run directory {run_dir}: {exc.strerror or exc} ({exc.filename}); "
            "make it writable or choose another run.output_root"
        ) from None
    return found
