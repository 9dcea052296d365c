"""The best checkpoint: the one at the best value of the task's ``best_metric`` (its direction from the
task), kept outside ``checkpoint.keep``'s pruning and named in the run directory's ``best`` file.

The loop saves a checkpoint after every evaluation that improves the best (``evaluation.py``), and every
checkpoint records the step of the best so far (``Position.best_step``). After each durable write the
checkpointer's pruning spares the checkpoint of that step, and when the newest checkpoint is itself the
best, rank 0 writes ``best`` (one line, its name: ``step-40.pt`` or ``step-40``) atomically through
``safefs``. The file is only a name: whoever uses it reads the checkpoint it names through the gate like
any other (``run.init_from=<run dir>/best`` does), so a forged or stale ``best`` can point at nothing
but a checkpoint that passes the same rules as every other.
"""

from __future__ import annotations

import re
from pathlib import Path

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths

_NAME = re.compile(r"step-(\d+)(\.pt)?")


def mark(paths: RunPaths, checkpoint: Path) -> None:
    """Rank 0: name ``checkpoint`` (durable, this run's) as the run's best."""
    safefs.write_atomic(paths.best, lambda f: f.write(f"{checkpoint.name}\n".encode()), paths.shared)


def named(paths: RunPaths) -> Path | None:
    """The checkpoint the run directory's ``best`` names (None: no ``best`` file); ValueError when the file
    does not hold a checkpoint's name. Nothing is read of the checkpoint: the caller passes it through the
    gate."""
    text = safefs.read_small(paths.best, limit=256)
    if text is None:
        return None
    name = text.strip()
    if not _NAME.fullmatch(name):
        raise ValueError(f"{paths.best} does not name a checkpoint ({name!r:.40})")
    return paths.checkpoints / name


def step_of(name: str) -> int | None:
    """The step in a checkpoint's name (``step-40.pt``, ``step-40``), or None."""
    found = _NAME.fullmatch(name)
    return int(found.group(1)) if found else None
