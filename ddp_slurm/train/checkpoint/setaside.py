"""Checkpoints newer than a step moved out of the way, never deleted: ``ddp-slurm resume --step N``
(``train/rewind.py``) and the guard's rollback (``guard/``) both go back this way.

They move into ``<run dir>/set-aside/<UTC time>-after-step-<N>/`` under their own names, with the ``best``
file when it named one of them (the checkpoint gone back to names its own best again); moving them back
into ``checkpoints/`` undoes it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import best


def set_aside(paths: RunPaths, step: int, newer: list[Path], best_step: int | None) -> str:
    """Move ``newer`` (checkpoints after ``step``) aside; the line that says what moved where.

    Every check comes before the first move: a ``best`` that is a link, a FIFO, a folder or too big is
    refused here (``UnsafePath``, exit 2) with nothing moved, never after the checkpoints went."""
    try:
        named = _named_best(paths)
    except safefs.UnsafePath as exc:
        raise safefs.UnsafePath(f"{exc}; nothing was set aside") from None
    name = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-after-step-{step}"
    safefs.make_dir(paths.set_aside, paths.shared, parents=False)
    folder = paths.set_aside / name
    for n in range(2, 1000):  # a rollback and its replay's go back within a second: one folder each
        if not os.path.lexists(folder):
            break
        folder = paths.set_aside / f"{name}-{n}"
    safefs.make_dir(folder, paths.shared, parents=False)
    for path in newer:
        os.rename(path, folder / path.name)
    moved = [p.name for p in newer]
    if named is not None and named.name in moved:  # the best is gone with them: the checkpoint's own best stays
        os.rename(paths.best, folder / paths.best.name)
        moved.append(paths.best.name)
        kept = [p for p in (paths.checkpoint(best_step), paths.sharded(best_step)) if best_step is not None]
        for path in kept:
            if path.exists():
                best.mark(paths, path)
    safefs.fsync_dir(paths.checkpoints)
    return (
        f"set aside {len(newer)} newer checkpoint(s) ({', '.join(moved)}) in {folder}; the run resumes at step {step}"
    )


def _named_best(paths: RunPaths) -> Path | None:
    try:
        return best.named(paths)
    except (ValueError, OSError):  # a damaged best file names nothing; the run writes a new one
        return None
