"""Stop signals from the first instruction of every entry point: a stop that comes while torch is
still importing, Ctrl-C (SIGINT) and a closed login shell (SIGHUP) are clean stops (one line, a
checkpoint, exit 75), not death by signal or a traceback.

Real processes and real signals; each signal is sent once the process catches it and before it has
mapped libtorch (checked), i.e. inside the window that used to be fatal.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Launcher

from ddp_slurm.train import checkpoint
from ddp_slurm.train.signals import EARLY_REQUEUE, StopFlag

TIMEOUT_S = 600.0
SHORT = ["model.name=mlp", "train.max_steps=3", "run.name=early"]


def catches(pid: int, sig: signal.Signals) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


def torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def signal_while_importing(proc: subprocess.Popen, sig: signal.Signals) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    # SIGUSR1: caught by nobody but the early flag (Python itself catches SIGINT from the start)
    while not catches(proc.pid, signal.SIGUSR1):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not torch_loaded(proc.pid), "too late: torch is already loaded"
    proc.send_signal(sig)


# --------------------------------------------------------------------------- the flag itself
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
def test_int_hup_and_term_are_stops_without_requeue(sig: signal.Signals) -> None:
    flag = StopFlag(signal.SIGUSR2).install()
    try:
        signal.raise_signal(sig)
    finally:
        flag.restore()
    assert flag.terminate_requested and not flag.requeue_requested


def test_early_flag_takes_every_candidate_then_the_config_narrows_it() -> None:
    flag = StopFlag.early()
    try:
        for sig in EARLY_REQUEUE:
            assert signal.getsignal(sig) == flag._handle, sig.name
        signal.raise_signal(signal.SIGUSR1)
        assert flag.requeue_requested  # before the config: any requeue candidate requeues
        flag.configure(signal.SIGUSR2)  # the config says USR2: the USR1 that came is a plain stop
        assert flag.terminate_requested and not flag.requeue_requested
        signal.raise_signal(signal.SIGUSR2)
        assert flag.requeue_requested
        assert flag.received == [signal.SIGUSR1, signal.SIGUSR2]
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


# --------------------------------------------------------------------------- real entry points
@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_stop_while_torch_imports_is_a_clean_stop_with_nothing_lost(tmp_path: Path, sig: signal.Signals) -> None:
    launcher = Launcher(tmp_path)
    proc = launcher.popen(launcher.cmd_train(*SHORT))
    signal_while_importing(proc, sig)
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 75, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    run_dir = tmp_path / "runs" / "early"
    assert [s for s, _ in checkpoint.list_checkpoints(run_dir)] == [0], out  # the stop checkpoint, step 0
    again = launcher.run(launcher.cmd_train(*SHORT), timeout=TIMEOUT_S)
    assert again.returncode == 0, again.stderr
    assert checkpoint.load_latest(run_dir)["step"] == 3


def test_launcher_stopped_before_any_worker_exits_75_in_one_line(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    cmd = [sys.executable, "-m", "ddp_slurm.launch", "--standalone", "--nproc_per_node", "1", "-m", "ddp_slurm.train"]
    proc = launcher.popen([*cmd, *SHORT])
    signal_while_importing(proc, signal.SIGTERM)
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 75, out
    assert "SIGTERM before any worker started" in out and "Traceback" not in out, out
    assert not (tmp_path / "runs").exists()
