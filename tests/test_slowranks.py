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

import pytest
import torch
from conftest import Launcher

from ddp_slurm.slurmjob import badnodes
from ddp_slurm.train import clock, metrics
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


class FakeDevice:
    """Stands in for a GPU (there is none here nor in CI): CUDA events that complete only when this device
    has run up to them (``run_to``) or when the host synchronizes on them, and whose ``elapsed_time`` raises,
    as CUDA's does, while either event is unfinished. ``held``: events recorded and not yet read."""

    def __init__(self) -> None:
        self.recorded, self.done, self.read = 0, 0, set()
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at: int | None = None

            def record(self) -> None:
                device.recorded += 1
                self.at = device.recorded

            def query(self) -> bool:
                return self.at is not None and self.at <= device.done

            def synchronize(self) -> None:
                device.done = max(device.done, self.at or 0)

            def elapsed_time(self, end: Event) -> float:
                if not (self.query() and end.query()):
                    raise RuntimeError("Both events must be completed before calculating elapsed time.")  # torch's
                device.read.update((self.at, end.at))
                return 2.0  # ms

        self.Event = Event

    def run_to(self, fraction: float) -> None:
        self.done = max(self.done, int(self.recorded * fraction))

    @property
    def held(self) -> int:
        return self.recorded - len(self.read)


def test_the_gpu_clock_holds_few_events_and_reads_them_only_once_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long log window on a GPU (1,000 steps, the device a few steps behind the host): the clock holds at
    most ``LIMIT`` pairs of events, reads none before it finished, and ``take`` (whichever hook ran before
    it) waits for the last ones itself. At world size 1 there is no clock at all."""
    fake = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    gpu = torch.device("cuda", 0)
    forward = lambda model, batch: torch.zeros(())  # noqa: E731
    timer = clock.ComputeClock(gpu)
    timed = timer.wrap(forward)
    most = 0
    for step in range(1000):
        timed(None, None)
        fake.run_to(0.99)  # the device trails the host by a step or so
        most = max(most, fake.held)
    assert most <= 2 * 64, f"{most} CUDA events held at once"  # clock.LIMIT pairs
    assert timer.take() == pytest.approx(1000 * 0.002)  # the unfinished last pairs: waited for, not raised on
    assert fake.held == 0 and timer.take() == 0.0
    assert clock.for_run(forward, gpu, 1) == (None, forward)  # nothing to compare: nothing added to a step
    assert fake.recorded == 2000 and isinstance(clock.for_run(forward, gpu, 2)[0], clock.ComputeClock)


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
    """Stop the process for 45 ms of every 50 ms (a node starved of CPU: about 10x slower), until ``stop``."""
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.045)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(0.005)


def test_a_rank_slowed_is_named_with_its_host_and_a_quiet_run_names_nobody(launcher: Launcher) -> None:
    quiet = launcher.run(launcher.cmd_torchrun(2, *RUN, "train.epochs=1", "run.name=quiet"), check=True)
    assert not [r for r in metrics.read(launcher.cwd / "runs" / "quiet" / "metrics.jsonl") if r["kind"] == "slow"]
    assert "is slow" not in quiet.stderr
    # A factor of 4 for the slowed run: a 10x slowdown is named, a busy machine's 2-3x jitter on rank 0 is not.
    slow = ("train.epochs=100", "slurm.slow_factor=4", "run.name=slow")
    proc = launcher.popen(launcher.cmd_torchrun(2, *RUN, *slow))
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
    assert (line["rank"], line["host"]) == (1, socket.gethostname()) and line["ratio"] > 4, line
    assert f"rank 1 (host {socket.gethostname()}) is slow" in out, out[-3000:]
    assert badnodes.excluded(launcher.cwd / "runs" / "slow", slow=True) == [socket.gethostname()]
    assert badnodes.excluded(launcher.cwd / "runs" / "slow") == []  # a slow node is not a lost one
