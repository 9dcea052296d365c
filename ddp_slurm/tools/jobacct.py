"""What Slurm's accounting says about a run's jobs: one line per job from ``seff`` or else ``sacct``.

The job ids come from the run's ``start`` lines (``job_id``, written by each launch inside Slurm) and
from the submitit log folders (``submitit/<job id>/``). Clusters without accounting (no ``seff``, or
``sacct`` answering "accounting storage is disabled") get one line saying so instead of an error.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddp_slurm.runpaths import RunPaths

SACCT_FIELDS = "JobID,JobName,State,Elapsed,NNodes,AllocTRES,ExitCode"
_SEFF_KEYS = ("State", "Nodes", "Cores per node", "CPU Efficiency", "Job Wall-clock time", "Memory Efficiency")


def job_ids(run_dir: Path, starts: Iterable[dict[str, Any]] = ()) -> list[str]:
    """Distinct Slurm job ids of a run, oldest first (a requeued job appears once)."""
    ids: list[str] = []
    for row in starts:
        job = row.get("job_id")
        if job not in (None, "") and str(job) not in ids:
            ids.append(str(job))
    folder = RunPaths(run_dir).submitit
    if folder.is_dir():
        for sub in sorted(folder.iterdir(), key=lambda p: p.name):
            if sub.is_dir() and re.fullmatch(r"\d+(_\d+)?", sub.name) and sub.name not in ids:
                ids.append(sub.name)
    return ids


def _run(cmd: list[str]) -> tuple[int, str]:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return res.returncode, (res.stdout if res.returncode == 0 else res.stderr or res.stdout)


def seff_line(job_id: str, text: str) -> str:
    """``seff``'s report condensed to one line."""
    found = dict(re.findall(r"^([A-Za-z][\w /-]*?):\s*(.+)$", text, re.M))
    parts = [f"{k.lower()} {found[k].strip()}" for k in _SEFF_KEYS if k in found]
    return f"job {job_id} (seff): " + "; ".join(parts) if parts else f"job {job_id} (seff): {text.strip()[:200]}"


def sacct_line(job_id: str, text: str) -> str:
    """``sacct -X -P -n -o SACCT_FIELDS`` output (one line per allocation) condensed to one line."""
    names = SACCT_FIELDS.split(",")
    rows = [dict(zip(names, line.split("|"))) for line in text.strip().splitlines() if line.strip()]
    if not rows:
        return f"job {job_id} (sacct): no record"
    r = rows[-1]  # a requeued job: the latest allocation
    more = f", {len(rows)} allocations" if len(rows) > 1 else ""
    return (
        f"job {job_id} (sacct): {r.get('State', '?')}, elapsed {r.get('Elapsed', '?')}, {r.get('NNodes', '?')} node(s), "
        f"{r.get('AllocTRES', '')}, exit {r.get('ExitCode', '?')}{more}"
    )


def describe(job_id: str) -> str:
    """One line about the job from ``seff`` if installed and working, else ``sacct``, else why not."""
    if shutil.which("seff"):
        code, out = _run(["seff", job_id])
        if code == 0 and out.strip():
            return seff_line(job_id, out)
    if not shutil.which("sacct"):
        return f"job {job_id}: no accounting tools here (neither seff nor sacct on PATH)"
    code, out = _run(["sacct", "-j", job_id, "-X", "-P", "-n", "-o", SACCT_FIELDS])
    if code != 0:
        reason = (out.strip().splitlines() or ["no reason given"])[-1]
        return f"job {job_id}: no accounting record ({reason.strip()})"
    return sacct_line(job_id, out)
