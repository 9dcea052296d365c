"""Talking to Slurm from inside a job: scontrol, requeue; and the job states after which a job is over."""

from __future__ import annotations

import logging
import shutil
import signal
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


def scontrol(*args: str, timeout_s: float = 60.0, ignore_term: bool = False) -> tuple[bool, str]:
    """Run ``scontrol ARGS``: (True, its output) or (False, why not: its message, a timeout, no scontrol).

    ``ignore_term``: the child ignores SIGTERM (inherited through exec). Right after ``scontrol requeue``
    Slurm sends SIGTERM to every process of the job, a command started then included; ignoring it, the
    command finishes within KillWait."""
    if shutil.which("scontrol") is None:
        return False, "scontrol not found on this node"
    try:
        res = subprocess.run(
            ["scontrol", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            preexec_fn=_ignore_term if ignore_term else None,
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:.0f} s"
    except OSError as exc:
        return False, str(exc)
    if res.returncode != 0:
        return False, (res.stderr or res.stdout).strip() or f"exit status {res.returncode}"
    return True, res.stdout


def _ignore_term() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def requeue(job_ref: str, timeout_s: float = 60.0) -> bool:
    """``scontrol requeue <job_ref>`` (``<array job>_<task>`` for array tasks). True on success.

    Slurm then ends this job run ("DUE TO JOB REQUEUE") and starts it again later with
    SLURM_RESTART_COUNT incremented and the same job id; the relaunch resumes from the run directory.
    """
    # the requeue itself sends SIGTERM to the job's processes, this command too while it awaits the reply: ignored,
    # or a requeue that went through reads as refused (exit -15) and a successor is chained besides
    ok, said = scontrol("requeue", job_ref, timeout_s=timeout_s, ignore_term=True)
    if not ok:
        log.warning(
            "scontrol requeue %s failed: %s (is the job submitted with --requeue?); launch again to resume",
            job_ref,
            said,
        )
        return False
    log.info("requeued Slurm job %s; it restarts from the checkpoint", job_ref)
    return True
