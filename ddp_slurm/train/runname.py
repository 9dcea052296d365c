"""A run name for a launch without ``run.name``: new for each launch, the same for all its ranks.

Every rank computes it from its own environment, with no communication, and gets the same answer:

* a Slurm job step (``srun``, also ``srun torchrun``): ``job-<job id>`` (``job-<array job>_<task>``
  for an array; ``.<step>`` added after the first step of a job). A requeued job keeps its id and
  restarts its steps from 0, so it finds its run directory again and resumes;
* torchrun outside Slurm: ``torchrun-<rendezvous id>`` (``TORCHELASTIC_RUN_ID``: a fresh uuid per
  ``--standalone`` launch, kept when the agent restarts its workers, which then resume);
* otherwise (one plain process): ``<date>-<time>`` from :func:`default_name`, numbered ``-2``, ``-3``,
  ... when that directory exists. Where several ranks have no shared id, rank 0 computes it and
  hands it to the others (the clocks of ranks differ).

A submitit job always gets its name at submission (``submit`` passes ``run.name``), so a resubmission
with a new job id still finds its directory.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import datetime


def slurm_name(environ: Mapping[str, str]) -> str | None:
    """``job-<id>[.<step>]`` inside a Slurm job step, else None."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    name = f"job-{array}_{task}" if array and task else f"job-{job}"
    step = environ.get("SLURM_STEP_ID", "0")
    return name if step in ("0", "") else f"{name}.{step}"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:13]  # a uuid's first groups: unique enough per machine


def launch_name(environ: Mapping[str, str]) -> str | None:
    """The name every rank of this launch derives alike, or None (then see :func:`default_name`)."""
    name = slurm_name(environ)
    if name:
        return name
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{_safe(run_id)}"
    return None


def default_name(environ: Mapping[str, str], now: datetime, exists: Callable[[str], bool]) -> str:
    """``run.name`` for a launch that gave none; ``exists(name)``: is ``<output_root>/<name>`` taken."""
    shared = launch_name(environ)
    if shared:
        return shared
    base = f"{now:%Y%m%d-%H%M%S}"
    name, n = base, 1
    while exists(name):
        n += 1
        name = f"{base}-{n}"
    return name
