"""Slow nodes named (ddp_slurm/train/hooks/slowranks.py, clock.py): a rank whose compute per step stays well
above the other ranks' is named with its host, in metrics.jsonl and ``slow_nodes``; a quiet run names nobody."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

from conftest import Launcher

from ddp_slurm.slurmjob import badnodes
from ddp_slurm.train import metrics
from ddp_slurm.train.clock import slow_ranks

RUN = [
    "model.name=mlp",
    "train.epochs=3",
    "train.log_every_steps=5",
    "slurm.slow_windows=3",
    "checkpoint.every_steps=0",
]


def test_the_slow_rank_is_the_one_above_the_others_median() -> None:
    assert slow_ranks([1.0, 2.0], 1.5) == [1]  # two ranks: each against the other
    assert slow_ranks([1.0, 1.1, 0.9, 3.0], 1.5) == [3]
    assert slow_ranks([1.0, 1.2, 1.1, 1.3], 1.5) == [] and slow_ranks([1.0], 1.5) == []
    assert slow_ranks([0.0, 0.0], 1.5) == []


def rank_pid(name: str, rank: int) -> int | None:
    """The training process of ``rank`` of the run named ``name`` (found through /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"run.name={name}".encode() in cmd and b"ddp_slurm.train" in cmd and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def slowed(pid: int, stop: threading.Event) -> None:
    """Stop the process for 20 ms of every 30 ms (a node starved of CPU), until ``stop``."""
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.02)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def test_a_rank_slowed_is_named_with_its_host_and_a_quiet_run_names_nobody(launcher: Launcher) -> None:
    quiet = launcher.run(launcher.cmd_torchrun(2, *RUN, "train.epochs=1", "run.name=quiet"), check=True)
    assert not [r for r in metrics.read(launcher.cwd / "runs" / "quiet" / "metrics.jsonl") if r["kind"] == "slow"]
    assert "is slow" not in quiet.stderr
    proc = launcher.popen(launcher.cmd_torchrun(2, *RUN, "train.epochs=100", "run.name=slow"))
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 120
        while (pid := rank_pid("slow", 1)) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pid is not None, "rank 1 never started"
        threading.Thread(target=slowed, args=(pid, stop), daemon=True).start()
        path = launcher.cwd / "runs" / "slow" / "metrics.jsonl"
        while time.monotonic() < deadline:
            named = [r for r in metrics.read(path) if r["kind"] == "slow"] if path.exists() else []
            if named:
                break
            time.sleep(0.5)
        assert named, "nobody was named"
    finally:
        stop.set()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    [line] = named
    assert (line["rank"], line["host"]) == (1, socket.gethostname()) and line["ratio"] > 1.5, line
    assert f"rank 1 (host {socket.gethostname()}) is slow" in out, out[-3000:]
    assert badnodes.excluded(launcher.cwd / "runs" / "slow", slow=True) == [socket.gethostname()]
    assert badnodes.excluded(launcher.cwd / "runs" / "slow") == []  # a slow node is not a lost one
