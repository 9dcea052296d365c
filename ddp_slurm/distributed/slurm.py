"""Talking to Slurm from inside a job: requeue; and the job states after which a job is over."""

from __future__ import annotations

import logging
import shutil
import subprocess

log = logging.getLogger(__name__)

# Job states after which Slurm will not run the job again (a requeued job goes back to PENDING).
ENDED_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)


def requeue(job_ref: str, timeout_s: float = 60.0) -> bool:
    """``scontrol requeue <job_ref>`` (``<array job>_<task>`` for array tasks). True on success.

    Slurm then ends this job run ("DUE TO JOB REQUEUE") and starts it again later with
    SLURM_RESTART_COUNT incremented and the same job id; the relaunch resumes from the run directory.
    """
    if shutil.which("scontrol") is None:
        log.warning("cannot requeue job %s: scontrol not found on this node; launch again to resume", job_ref)
        return False
    try:
        res = subprocess.run(["scontrol", "requeue", job_ref], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("scontrol requeue %s timed out after %.0f s; launch again to resume", job_ref, timeout_s)
        return False
    if res.returncode != 0:
        log.warning(
            "scontrol requeue %s failed: %s (is the job submitted with --requeue?); launch again to resume",
            job_ref,
            (res.stderr or res.stdout).strip(),
        )
        return False
    log.info("requeued Slurm job %s; it restarts from the checkpoint", job_ref)
    return True
