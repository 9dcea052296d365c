"""Names of new run directories (a launch, or a submission, without ``run.name``). Torch-free: submit uses it.

Inside a Slurm job the job names the run (``<task>-<job id>``): the same on every rank and after every
requeue. Elsewhere rank 0 picks ``<task>-<date>-<time>`` and hands it to the others; ``submit`` picks
it at submission, so that a resubmitted job (a new job id) still finds its directory.
"""

from __future__ import annotations

import time
from pathlib import Path

from ddp_slurm.config import Config


def base_name(cfg: Config) -> str:
    """What new run directories of this task are called: the task class name, lower case."""
    return cfg.task.rpartition(":")[2].rpartition(".")[2].lower() or "run"


def job_name(cfg: Config, job_ref: str | None) -> str | None:
    """Inside a Slurm job: ``<task>-<job id>`` (``<array job>_<task id>`` for arrays). The same on every
    rank and after every requeue of the job; None outside Slurm."""
    return f"{base_name(cfg)}-{job_ref}" if job_ref else None


def new_name(cfg: Config, now: float | None = None) -> str:
    """Rank 0, for a launch without run.name outside Slurm: ``<task>-<YYYYmmdd-HHMMSS>``, with a
    ``-2``, ``-3``... suffix when that directory exists already (two launches in one second)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    name = f"{base_name(cfg)}-{stamp}"
    root, n = Path(cfg.run.output_root), 1
    while (root / name).exists():
        n += 1
        name = f"{base_name(cfg)}-{stamp}-{n}"
    return name
