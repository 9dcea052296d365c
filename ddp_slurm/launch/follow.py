"""``--wait``: follow submitted jobs to their end and turn what they left into an exit status.

The job's state comes from ``scontrol show job`` (submitit's own watcher needs ``sacct``, which many
clusters, and the test cluster, do not have) or, for the local executor, from the controller
process. What happened comes from submitit's per-task result files: success (rank 0's summary),
error (``TrainingFailed`` and the exit code in its message), or none, which means the job stopped
on a signal with a checkpoint (metrics.jsonl ends with a ``stop`` line) or died (killed, node lost).
A requeued job is not over: it goes back to PENDING, its log is appended to, and following goes on.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ddp_slurm import safefs
from ddp_slurm.exitcodes import EXIT_STOPPED
from ddp_slurm.launch.sweep import summarize
from ddp_slurm.slurmjob.slurm import ENDED_STATES
from ddp_slurm.tools import tracked

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    code: int  # the exit status of `submit --wait`: training's (0, 1, 2, 3, 75)
    message: str  # one line
    detail: list[str]  # the failing rank's last log lines (empty on success)


def slurm_state(job_id: str) -> str | None:
    """``JobState`` from ``scontrol show job``; None once Slurm has forgotten the job (or cannot say)."""
    if shutil.which("scontrol") is None:
        return None
    try:
        res = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "UNKNOWN"  # a busy controller: ask again later
    match = re.search(r"\bJobState=(\S+)", res.stdout)
    return match[1] if res.returncode == 0 and match else None


class LogTail:
    """Copies what is appended to a file (a rank's log) to a stream, from where it last stopped."""

    def __init__(self, path: Path, out: TextIO) -> None:
        self.path, self.out, self.pos = path, out, 0

    def pump(self) -> None:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.pos)
                text = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return
        if text:
            self.out.write(text)
            self.out.flush()


def last_lines(path: Path, n: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def task_results(job: Any) -> list[tuple[str, Any] | None]:
    """Per task: submitit's ``(outcome, value)`` from its result file, or None where there is none."""
    from submitit.core.utils import pickle_load

    out: list[tuple[str, Any] | None] = []
    for task in range(job.num_tasks):
        path = job.task(task).paths.result_pickle
        try:
            out.append(pickle_load(path) if path.exists() and _trusted(path) else None)
        except (EOFError, OSError):  # being written right now
            out.append(None)
    return out


def _trusted(path: Path) -> bool:
    """Unpickling runs code: only a result file that no other user could have written or replaced (this
    user's, in this user's folder, neither writable by group or others) is read. Otherwise the outcome is
    taken from the run directory's metrics (``outcome`` falls back to it) and a warning says why."""
    try:
        safefs.check_trusted(path.parent, use="unpickle results from")
        safefs.check_trusted(path, use="unpickle")
    except safefs.UnsafePath as exc:
        log.warning("not reading the result file: %s", exc)
        return False
    return True


def is_active(job: Any, cluster: str, seen_ended: dict[str, int]) -> bool:
    """Still pending or running. A Slurm state that means "ended" must be seen twice in a row: a job
    being requeued passes through states (PREEMPTED, COMPLETING) on its way back to PENDING."""
    if cluster != "slurm":
        return not job.done()
    state = slurm_state(job.job_id)
    if state is not None and state not in ENDED_STATES:
        seen_ended.pop(job.job_id, None)
        return True
    seen_ended[job.job_id] = seen_ended.get(job.job_id, 0) + 1
    return seen_ended[job.job_id] < 2


def settle(job: Any, cluster: str, timeout_s: float = 60.0) -> None:
    """Every task has returned; wait for the job itself to end (processes exit, Slurm completes the
    step), so that whatever runs after ``--wait`` finds the job over and its nodes free."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cluster != "slurm":
            if job.done():
                return
        elif (state := slurm_state(job.job_id)) is None or state in ENDED_STATES:
            return
        time.sleep(0.5)


def wait_for(
    jobs: list[Any],
    cluster: str,
    on_poll: Callable[[], None] = lambda: None,
    on_done: Callable[[Any], None] = lambda job: None,
) -> None:
    """Block until every job has a result from each task or has ended. Result files are checked every
    second; the scheduler is asked less and less often (2 s, then up to every 15 s)."""
    pending = list(jobs)
    seen_ended: dict[str, int] = {}
    next_ask, interval = 0.0, 2.0
    while pending:
        on_poll()
        ask = cluster != "slurm" or time.monotonic() >= next_ask
        if ask and cluster == "slurm":
            next_ask, interval = time.monotonic() + interval, min(15.0, interval * 1.5)
        for job in list(pending):
            returned = all(r is not None for r in task_results(job))  # every task wrote its result
            if not returned and not (ask and not is_active(job, cluster, seen_ended)):
                continue  # pending or running
            if returned:
                settle(job, cluster)
            elif cluster == "slurm":
                time.sleep(0.5)  # a result file still landing on a shared file system
            pending.remove(job)
            on_done(job)
        if pending:
            time.sleep(1.0)
    on_poll()


def finished_message(result: dict[str, Any]) -> str:
    """One line from rank 0's result (``TrainJob``'s return value)."""
    name, final = result.get("metric"), result.get("final")
    shown = (
        f", final test {name} {'n/a' if final is None else tracked.show(name, final, result.get('percent'))}"
        if name
        else ""
    )
    return f"finished: {result['step']} steps{shown}; run directory {result['run_dir']}"


STOPPED_MESSAGE = (
    "stopped on a signal with a checkpoint at step {step} and not requeued: submit the same command again to resume"
)


def outcome(job: Any, run_dir: Path, cluster: str) -> Outcome:
    """What the ended job left behind, as an exit status and a message."""
    results = task_results(job)
    first = results[0]
    if first is not None and first[0] == "success":
        return Outcome(0, finished_message(first[1]), [])
    errors = [(task, res[1]) for task, res in enumerate(results) if res is not None and res[0] == "error"]
    if errors:
        task, trace = errors[0]
        lines = [line for line in str(trace).strip().splitlines() if line.strip()]
        reason = lines[-1].split(": ", 1)[-1] if lines else "unknown error"
        match = re.search(r"training exited (\d+) on rank", reason)
        return Outcome(
            int(match[1]) if match else 1, f"rank {task} failed: {reason}", last_lines(job.task(task).paths.stdout)
        )
    run = summarize(run_dir)
    if run.status == "stopped":
        return Outcome(EXIT_STOPPED, STOPPED_MESSAGE.format(step=run.step), [])
    if run.status == "finished":
        return Outcome(0, f"finished: {run.step} steps (no result file); run directory {run_dir}", [])
    state = slurm_state(job.job_id) if cluster == "slurm" else None
    return Outcome(
        1,
        f"job {job.job_id} ended{f' ({state})' if state else ''} without a result: killed, "
        "cancelled or lost its node; rank 0's last lines above",
        last_lines(job.task(0).paths.stdout),
    )


def report(result: Outcome, out: TextIO | None = None) -> int:
    """Print the outcome (the failing rank's lines on stdout, a failure's one line on stderr); its code."""
    out = out or sys.stdout
    if result.detail:
        out.write("--- last lines of the failing rank's log\n" + "\n".join(result.detail) + "\n---\n")
    print(result.message, file=out if result.code == 0 else sys.stderr)
    return result.code
