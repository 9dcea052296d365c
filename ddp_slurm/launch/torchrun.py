"""``python -m ddp_slurm.launch [torchrun options] -m ddp_slurm.train ...``: torchrun that survives Slurm's stop signal.

Why it exists: Slurm delivers ``--signal=USR2@N`` and ``scancel --signal=USR2`` to every process of
the job step, so under ``srun torchrun ...`` both the training workers and the torchrun agent that
started them get SIGUSR2. The agent handles only TERM, INT, HUP and QUIT; SIGUSR1/SIGUSR2 keep their
default action, which terminates it. The agent then dies at the moment the workers begin their
checkpoint, srun sees a task killed by a signal and (``--kill-on-bad-exit``) kills the whole step:
no checkpoint, no requeue.

What it does, before importing torch (so the window in which the signal is still fatal is a few
milliseconds of interpreter start-up):

* catches SIGUSR1 and SIGUSR2 in the agent and passes each one on to the agent's worker processes.
  Under Slurm the workers got their own copy already and a second one changes nothing (the request
  is a flag); forwarding makes a signal sent to the agent alone (``kill -USR2 <agent pid>``, other
  schedulers) reach the workers too;
* runs torchrun's own ``run`` with the arguments unchanged;
* exits 75 when every worker of this node exited 75 ("stopped after a checkpoint, launch again to
  resume"), instead of torchrun's failure report and exit 1, so the job's exit status says what
  happened;
* ends a worker's failure with one line (which rank, its exit code, where torchrun's full report was
  written) and the worker's own exit status, instead of ~45 lines of report and traceback after the
  worker's error.

SIGTERM stays with torchrun: it passes it on to the workers and gives them ``--shutdown-timeout``
seconds (default 30) to write their checkpoint and exit before it kills them; the launcher then
exits 128 + the signal number with one line instead of torchrun's traceback.

Recent torch versions can also be told ``--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2``;
the agent then forwards SIGUSR2 as well, but treats it as a shutdown: it kills workers still busy
after the shutdown timeout and exits with a traceback. This launcher lets the workers end on their
own and works with every torch release the package supports.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType

from ddp_slurm import exitcodes
from ddp_slurm.exitcodes import EXIT_STOPPED
from ddp_slurm.train.signals import StopFlag

log = logging.getLogger("ddp_slurm.launch")


FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def child_pids(parent: int) -> list[int]:
    """Pids of the direct children of ``parent`` (Linux /proc); torchrun's workers are children of the agent."""
    children = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            children.append(int(entry.name))
    return children


class SignalForwarder:
    """Handlers that pass ``signals`` on to this process's children instead of letting them kill it."""

    def __init__(self, signals: Iterable[signal.Signals] = FORWARDED_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: list[signal.Signals] = []

    def install(self) -> SignalForwarder:
        for sig in self.signals:
            signal.signal(sig, self._forward)
        return self

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        self.received.append(sig)
        sent = 0
        for pid in child_pids(os.getpid()):
            try:
                os.kill(pid, sig)
                sent += 1
            except ProcessLookupError:
                pass
        # os.write, not logging: a handler may interrupt the main thread inside a logging call.
        what = f"passed on to {sent} worker process(es)" if sent else "no worker is running yet: dropped"
        os.write(2, f"launch [{socket.gethostname()}]: {sig.name} {what}\n".encode())


def _stopped(exc) -> bool:
    """True when this node's workers stopped cleanly: each exited 75, or was ended by the SIGTERM that
    torchrun sends to the rest of the group as soon as one worker has exited (at least one exited 75)."""
    codes = [f.exitcode for f in exc.failures.values()]
    return EXIT_STOPPED in codes and all(code in (EXIT_STOPPED, -signal.SIGTERM) for code in codes)


def _failed(exc) -> int:
    """One line for a worker that failed, instead of torchrun's report and the launcher's traceback (~45 lines
    after the worker's own error): which rank, how it ended, and the file that keeps the whole report.
    The exit status is the worker's own (2 for a config error, 128 + N for a signal), as a plain run's."""
    import traceback

    rank, failure = exc.get_first_failure()
    fd, report = tempfile.mkstemp(prefix="ddp-slurm-launch-", suffix=".log")  # private to this user (0600)
    with os.fdopen(fd, "w") as out:
        out.write(exc.format_msg() + "\n" + "".join(traceback.format_exception(exc)))
    if failure.exitcode < 0:
        how, code = f"was killed by {failure.signal_name()}", 128 - failure.exitcode
    else:
        how, code = f"exited {failure.exitcode}", failure.exitcode or 1
    log.error(
        "worker rank %d (local rank %d, pid %d) %s: its error is in the lines above; exit %d "
        "(torchrun's full report: %s)",
        rank,
        failure.local_rank,
        failure.pid,
        how,
        code,
        report,
    )
    return code


WORKER_STOP_WAIT_S = 120.0
"""How long a launcher interrupted by Ctrl-C waits for its workers' own exits (their stop checkpoint)."""


def _await_workers(exit_dir: Path, expected: int | None, limit_s: float = WORKER_STOP_WAIT_S) -> None:
    """After Ctrl-C: until every local worker has exited (its code in ``exit_dir``), at most ``limit_s``. A
    second Ctrl-C pressed at once (a mashed key, the terminal's whole group) interrupts torchrun's own wait
    for them: the agent would say 130 while they still checkpoint. Further SIGINTs are ignored meanwhile (the
    workers have them already); SIGTERM or SIGKILL still end the launcher."""
    if expected is None:
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            found = exitcodes.codes(exit_dir)  # STARTED until a worker writes its exit code
            if len(found) >= expected and exitcodes.STARTED not in found:
                break
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, previous)


def _local_workers(args) -> int | None:
    """Workers this node's agent starts (``--nproc-per-node N``), None where torchrun decides (``auto``, ``gpu``)."""
    n = str(getattr(args, "nproc_per_node", ""))
    return int(n) if n.isdigit() else None


HELP = """\
usage: python -m ddp_slurm.launch [torchrun options] -m ddp_slurm.train [--config FILE] [KEY=VALUE ...]

torchrun, with what a Slurm job needs added (every torchrun option works unchanged):
  * SIGUSR1/SIGUSR2 (Slurm's --signal=USR2@N, scancel --signal=USR2) no longer kill the torchrun agent:
    it stays up and passes the signal on to its workers, which checkpoint and stop at the same step;
  * exit status 75 when every worker of the node stopped after a checkpoint ("launch again to
    resume"), instead of torchrun's failure report and exit 1;
  * a worker's failure ends with one line and the worker's exit status (torchrun's full report goes
    to a file that line names);
  * on SIGTERM (a requeue, a preemption, scancel): torchrun passes it on and waits --shutdown-timeout
    seconds as usual, then this exits 128+signal with one line instead of a traceback.

Use it wherever you would write `torchrun`, e.g. in an sbatch script:
  srun --ntasks-per-node=1 python -m ddp_slurm.launch --nnodes=$SLURM_JOB_NUM_NODES --nproc-per-node=4 \\
      --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 --rdzv-id=$SLURM_JOB_ID -m ddp_slurm.train ...

torchrun's own options: `torchrun --help` (or `python -m torch.distributed.run --help`).
"""


def wants_help(argv: list[str]) -> bool:
    """``-h``/``--help`` among the launcher's options (before the training module or script)."""
    for arg in argv:
        if arg in ("-h", "--help"):
            return True
        if arg in ("-m", "--module") or arg.endswith(".py"):
            return False
    return False


def main(argv: list[str] | None = None, early: StopFlag | None = None) -> int:
    """Run torchrun with ``argv`` (default: the command line); returns the exit status.

    ``early``: the flag ``python -m ddp_slurm.launch`` installed as its first instruction; a stop signal
    that arrived before any worker was started ends the launch with exit 75 (nothing to lose yet).
    """
    if early is None:
        SignalForwarder().install()  # first: until this line SIGUSR2 would kill the agent
    args = sys.argv[1:] if argv is None else list(argv)
    if wants_help(args):  # our own help, without importing torch (torchrun's would take seconds)
        sys.stdout.write(HELP)
        return 0
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s launch [{socket.gethostname()}]: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    @record
    def launch(args, exit_dir: Path) -> int:
        try:
            torchrun.run(args)
        except ChildFailedError as exc:
            if _stopped(exc):
                log.info(
                    "all workers stopped on a signal after a checkpoint: exit %d (rank 0's line above names the command "
                    "that resumes)",
                    EXIT_STOPPED,
                )
                return EXIT_STOPPED
            return _failed(exc)
        except SignalException as exc:
            # SIGTERM & co. (a requeue, a preemption, scancel): torchrun has already passed it on to the
            # workers and waited for them, which checkpoint on SIGTERM. One line instead of a traceback.
            sig = signal.Signals(exc.sigval)
            if sig == signal.SIGINT:
                _await_workers(exit_dir, _local_workers(args))
            if sig == signal.SIGINT and exitcodes.all_stopped(exit_dir, _local_workers(args), EXIT_STOPPED):
                log.info(
                    "interrupted: every worker stopped after a checkpoint; exit %d (rank 0's line above names the "
                    "command that resumes)",
                    EXIT_STOPPED,
                )
                return EXIT_STOPPED
            log.info("agent got %s: the workers were told to stop; exit %d", sig.name, 128 + sig)
            return 128 + sig
        return 0

    parsed = torchrun.parse_args(args)
    if early is not None:  # it recorded every stop signal while torch was imported
        early.restore()  # torchrun's agent takes TERM, INT and HUP (and passes them to the workers)
        SignalForwarder().install()
    if early is not None and early.received:
        names = ", ".join(signal.Signals(s).name for s in early.received)
        log.info("%s before any worker started: nothing to save; exit %d (launch again)", names, EXIT_STOPPED)
        return EXIT_STOPPED
    workers = _local_workers(parsed)
    if "OMP_NUM_THREADS" not in os.environ and workers is not None and workers > 1:
        # torchrun's own choice for several workers (one thread each), made here so that its five-line banner
        # does not open every launch; set OMP_NUM_THREADS to give each worker more
        os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="ddp-slurm-exits-") as exit_dir:
        os.environ[exitcodes.EXIT_DIR_ENV] = exit_dir  # the workers inherit it (see exitcodes.py)
        return launch(parsed, Path(exit_dir))


if __name__ == "__main__":
    sys.exit(main())
