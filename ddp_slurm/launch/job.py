"""The callable that ``python -m ddp_slurm.submit`` hands to submitit: one rank of the training run.

Every task of the submitit job runs :class:`TrainJob`, which calls ``ddp_slurm.train.cli.run`` with
the same ``--config`` and overrides as ``python -m ddp_slurm.train`` would get. The pickle holds
only those arguments: training state lives in the run directory, so a requeued job (same pickle)
resumes from the latest checkpoint.

One signal path. submitit's ``process_job`` installs its own handlers before calling us: on the
preemption signal, rank 0 would requeue and exit at once while the other ranks carry on. So the
first thing ``__call__`` does is install training's :class:`~ddp_slurm.train.signals.StopFlag` in their
place and keep it until the process ends: every rank stops at the same step, rank 0 writes the
checkpoint and runs ``scontrol requeue`` once, and submitit's handlers never run.

Exit status of training inside the callable:
- ``0``: returns the run's summary (final accuracy, run directory): the job's result;
- ``75`` (stopped on a signal after a checkpoint): ``SystemExit(75)``, like submitit's own
  requeue path, so no result file is written and the requeued run writes it later;
- anything else: :class:`TrainingFailed`, whose message submitit stores as the job's error.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from ddp_slurm import errors, safefs
from ddp_slurm.distributed.env import TORCHRUN_LAYOUT_VARS
from ddp_slurm.exitcodes import EXIT_STOPPED, exit_now
from ddp_slurm.train.signals import StopFlag, parse_signal

_MEANING = {1: "failure", 2: "usage or config error", 3: "requeue cap reached (slurm.max_requeues)"}
# Layout variables a submitting shell may export (after a torchrun session) that must not reach a Slurm task.
_SUBMITTER_LAYOUT = (*TORCHRUN_LAYOUT_VARS, "MASTER_ADDR")


def _leave_before_finalizing(outcome: dict[str, int]) -> None:
    """atexit, in a submitit worker process: exit with the job's code before the interpreter finalizes.

    By then submitit has written the result file (or, for exit 75, nothing). Finalization is what
    ``exitcodes.exit_now`` skips for ``python -m ddp_slurm.train``: a thread still inside torch's C++ (a
    gloo worker, a store call) that wants the interpreter lock back during it aborts the process
    ("terminate called without an active exception", exit 134), turning a finished job into a
    FAILED one. atexit handlers run before that point. An exception that reached the top after
    training succeeded (submitit could not write the result) still exits 1.
    """
    failed_after = getattr(sys, "last_value", None) is not None  # set when Python printed an uncaught exception
    exit_now(1 if failed_after and outcome["code"] == 0 else outcome["code"])


class TrainingFailed(errors.Error):
    """Training exited with a failure code; ``code`` (and ``exit_code``) is that exit code."""

    def __init__(self, code: int, rank: int, reason: str) -> None:
        self.code, self.rank = code, rank
        self.exit_code = code
        super().__init__(f"training exited {code} on rank {rank} ({_MEANING.get(code, 'failure')}): {reason}")


class _LastError(logging.Handler):
    """Keeps the last ERROR line that training logged, for the exception's message."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage().splitlines()[0] if record.getMessage() else ""


def local_rank_environ(job_env: Any, master_port: int) -> dict[str, str]:
    """torchrun-style variables for one task of submitit's local executor (one node, N tasks)."""
    n = str(job_env.num_tasks)
    return {
        "RANK": str(job_env.global_rank),
        "LOCAL_RANK": str(job_env.local_rank),
        "WORLD_SIZE": n,
        "LOCAL_WORLD_SIZE": n,
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }


@dataclass
class TrainJob:
    """``python -m ddp_slurm.train ARGV`` as a submitit callable (see the module docstring)."""

    argv: list[str]
    """Arguments of ``ddp_slurm.train`` (``--config``, then ``KEY=VALUE`` overrides)."""
    run_dir: str
    """Absolute run directory (for the result and messages)."""
    signal: str
    """``slurm.signal``: the signal that means checkpoint, requeue and stop."""
    workdir: str
    """Working directory at submission (relative paths in the config are relative to it)."""
    master_port: int = 0
    """Rendezvous port under the local executor (picked free at submission, the same for every task)."""

    def __call__(self) -> dict[str, Any]:
        stop = StopFlag(parse_signal(self.signal)).install()  # first: no signal may reach submitit's handlers
        safefs.tighten_umask()  # the result file submitit writes after we return: not writable by others
        import submitit

        job_env = submitit.JobEnvironment()
        in_process = job_env.cluster == "debug"  # the debug executor runs us inside the submitting process
        outcome = {"code": 1}
        if not in_process:  # this process only runs this job: leave it without finalizing (_leave_before_finalizing)
            atexit.register(_leave_before_finalizing, outcome)
        try:
            result = self._run(job_env, stop)
            outcome["code"] = 0
            return result
        except SystemExit as exc:
            outcome["code"] = exc.code if isinstance(exc.code, int) else 1
            raise
        finally:
            if in_process:
                stop.restore()
            # Otherwise keep the flag until the process ends: a late second signal (Slurm's time-limit
            # signal after a manual one) must not reach submitit's handler and requeue the job twice.

    def _run(self, job_env: Any, stop: StopFlag) -> dict[str, Any]:
        from ddp_slurm.launch.sweep import summarize
        from ddp_slurm.train import cli

        rank = job_env.global_rank
        if job_env.cluster == "local":
            # No Slurm step here: describe the layout the way torchrun does. Slurm variables inherited
            # from an enclosing allocation would make training requeue that allocation: drop them.
            for key in [k for k in os.environ if k.startswith("SLURM_")]:
                del os.environ[key]
            os.environ.update(local_rank_environ(job_env, self.master_port))
        elif job_env.cluster == "slurm":
            # The srun step describes the layout; torchrun variables (and a MASTER_ADDR) exported from
            # the submitting shell would win over it and describe something else.
            for key in _SUBMITTER_LAYOUT:
                os.environ.pop(key, None)
        os.chdir(self.workdir)
        # submitit's logger also propagates to the root logger that training sets up: every line twice.
        logging.getLogger("submitit").propagate = False
        errors = _LastError()
        logging.getLogger("ddp_slurm").addHandler(errors)
        try:
            code = cli.run(self.argv, stop=stop)
        finally:
            logging.getLogger("ddp_slurm").removeHandler(errors)
        if code == 0:
            return {"rank": rank, **summarize(self.run_dir).as_dict()}
        if code == EXIT_STOPPED:
            raise SystemExit(EXIT_STOPPED)  # not an error: the job is requeued (or resubmit to resume)
        raise TrainingFailed(code, rank, errors.message or "see this rank's log")

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's requeue hook: resubmit unchanged; training resumes from the run directory.

        Only reached if submitit's own handler ran, i.e. a signal in the instant before
        ``__call__`` installed training's flag, when no training had started.
        """
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)
