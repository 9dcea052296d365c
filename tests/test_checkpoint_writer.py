"""Asynchronous checkpoints (train/checkpoint/wholefile_writer.py), with real threads, processes, signals and files.

The component is tested in-process (snapshot semantics, one write in flight, failures surfacing) and
through ``python -m ddp_slurm.bench.ckpt_worker``, a small training process that checkpoints with it
the way the training loop does: stop signals mid-write, SIGKILL mid-write, a writer that fails, and
bit-identical resume at world size 1 and 2 (torchrun, gloo).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import base_env

from ddp_slurm import config
from ddp_slurm.train import checkpoint
from ddp_slurm.train.checkpoint.snapshot import Snapshotter, state_bytes
from ddp_slurm.train.checkpoint.wholefile_writer import AsyncCheckpointer

EXIT_STOPPED = 75


def small_state(step: int, value: float = 1.0) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 64), value), "b": torch.arange(10.0)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(64) * value}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": step,
        "epoch": 0,
        "samples_in_epoch": step * 8,
        "finished": False,
        "meta": {"history": [step]},
    }


# ---------------------------------------------------------------- the component, in-process


@pytest.fixture(params=["process", "thread"])
def writer(request) -> str:
    """Both writers: a thread (the default) and a forked process."""
    return request.param


def test_snapshot_holds_the_values_of_the_save_call_not_later_ones(tmp_path: Path, writer: str) -> None:
    """The caller changes its tensors and plain values in place right after save() returns (the next
    optimizer step does): the checkpoint holds the values as they were at the call."""
    state = small_state(5, value=1.0)
    ckpt = AsyncCheckpointer(tmp_path, keep=3, writer=writer)
    assert ckpt.save(state) is None and ckpt.in_flight
    state["model"]["w"].add_(100.0)
    state["optimizer"]["state"][0]["exp_avg"].mul_(0)
    state["meta"]["history"].append(6)
    path = ckpt.wait()
    assert path == tmp_path / "checkpoints" / "step-5.pt" and not ckpt.in_flight
    saved = checkpoint.load(path)
    assert torch.equal(saved["model"]["w"], torch.full((64, 64), 1.0))
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], torch.ones(64))
    assert saved["meta"] == {"history": [5]} and saved["step"] == 5


def test_buffers_are_reused_and_dropped_when_the_layout_changes() -> None:
    snap = Snapshotter()
    a, _ = snap.copy(small_state(1))
    held = snap.held_bytes
    assert held == state_bytes(small_state(1))
    b, _ = snap.copy(small_state(2, value=2.0))
    assert b["model"]["w"].data_ptr() == a["model"]["w"].data_ptr()  # same buffer, new values
    assert torch.equal(b["model"]["w"], torch.full((64, 64), 2.0))
    other = {"model": {"v": torch.zeros(3)}, "step": 3}
    snap.copy(other)
    assert snap.held_bytes == 12  # the old layout's buffers are gone: never two copies held


def test_at_most_one_write_in_flight(tmp_path: Path, writer: str) -> None:
    """A second save waits for the first to be durable before it starts (bounded memory, ordered files)."""
    durable: list[tuple[str, float]] = []
    ckpt = AsyncCheckpointer(tmp_path, keep=10, writer=writer, on_durable=lambda p, t: durable.append((p.name, t)))
    ckpt.save(small_state(1))
    ckpt.save(small_state(2))  # returns only once step-1 is on disk
    assert [name for name, _ in durable] == ["step-1.pt"]
    assert ckpt.wait() == tmp_path / "checkpoints" / "step-2.pt"
    assert [name for name, _ in durable] == ["step-1.pt", "step-2.pt"]
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2, 1]
    assert threading.active_count() == 1  # no writer thread left behind


def test_poll_returns_a_finished_write_once_and_never_blocks(tmp_path: Path, writer: str) -> None:
    ckpt = AsyncCheckpointer(tmp_path, keep=3, writer=writer)
    assert ckpt.poll() is None  # nothing in flight
    ckpt.save(small_state(7))
    deadline = time.monotonic() + 60
    found = None
    while found is None and time.monotonic() < deadline:
        found = ckpt.poll()
        time.sleep(0.01)
    assert found == tmp_path / "checkpoints" / "step-7.pt"
    assert ckpt.poll() is None and ckpt.wait() is None


def test_collect_durable_says_a_finished_write_at_once_and_leaves_a_failure_to_wait(
    tmp_path: Path, writer: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What the loop asks every step (rank 0): a durable write is logged then, not at the next save after
    the progress lines of every step between; a failed one is not raised by one rank alone (the stop vote
    makes every rank raise it together), and ``wait`` still raises it."""
    durable: list[str] = []
    ckpt = AsyncCheckpointer(tmp_path, keep=3, writer=writer, on_durable=lambda p, t: durable.append(p.name))
    assert ckpt.collect_durable() is None  # nothing in flight
    ckpt.save(small_state(10))
    ckpt._write.join()
    with caplog.at_level("INFO"):
        assert ckpt.collect_durable() == tmp_path / "checkpoints" / "step-10.pt"
    assert "step-10.pt written in the background" in caplog.text and durable == ["step-10.pt"]
    assert ckpt.collect_durable() is None and not ckpt.in_flight
    (tmp_path / "checkpoints").rename(tmp_path / "moved")
    (tmp_path / "checkpoints").write_text("not a directory")
    ckpt.save(small_state(20))
    ckpt._write.join()
    assert ckpt.collect_durable() is None and ckpt.failed
    with pytest.raises(checkpoint.CheckpointError, match="step-20.pt"):
        ckpt.wait()
    ckpt.close()


def test_urgent_save_cancels_an_older_write(tmp_path: Path, writer: str) -> None:
    """A stop signal's save of a newer step: the in-flight write of an older step is cancelled (a
    process killed, a thread stopped at its next tensor or write) and its temporary file removed, so
    the stop checkpoint costs one write, not one and a half. The newer step is durable, the older one
    never appears and nothing half-written stays."""
    ckpt = AsyncCheckpointer(tmp_path, keep=10, writer=writer)
    ckpt.save({**small_state(1), "big": torch.rand(64 * 2**20)})  # 256 MiB: still being written below
    ckpt.save(small_state(2), urgent=True)
    assert ckpt.wait() == tmp_path / "checkpoints" / "step-2.pt"
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2]
    assert checkpoint.latest(tmp_path)[1]["step"] == 2
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))
    assert threading.active_count() == 1  # the cancelled writer thread is gone


def test_a_stop_during_the_wait_for_an_older_write_cancels_it(tmp_path: Path, writer: str) -> None:
    """A save that waits for the write in flight (not urgent) stops waiting once ``stop_pending`` says a
    stop signal came: the older write is cancelled and this step is written, so the stop checkpoint
    that follows never queues behind two writes."""
    stop = threading.Event()
    ckpt = AsyncCheckpointer(tmp_path, keep=10, writer=writer, stop_pending=stop.is_set)
    ckpt.save({**small_state(1), "big": torch.rand(64 * 2**20)})  # 256 MiB: still being written below
    threading.Timer(0.05, stop.set).start()
    ckpt.save(small_state(2))
    assert ckpt.wait() == tmp_path / "checkpoints" / "step-2.pt"
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2]
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))


def test_disabled_saves_synchronously(tmp_path: Path) -> None:
    ckpt = AsyncCheckpointer(tmp_path, keep=3, enabled=False)
    assert ckpt.save(small_state(3)) == tmp_path / "checkpoints" / "step-3.pt"
    assert not ckpt.in_flight and checkpoint.load_latest(tmp_path)["step"] == 3


def test_a_synchronous_save_of_gpu_state_copies_it_to_host_and_waits_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint.async=false on a GPU: the state is copied to host buffers in one batch and the save waits
    for the last copy only (torch.save of live CUDA tensors would wait once per tensor); torch.save then
    sees host tensors. No GPU here: the snapshot's copy and its CUDA events are stand-ins."""
    from ddp_slurm.train.checkpoint import wholefile_writer as writer_module

    waits: list[int] = []

    class Event:
        def __init__(self, i: int) -> None:
            self.i = i

        def synchronize(self) -> None:
            waits.append(self.i)

    copies: list[dict[str, Any]] = []

    def copy(state: dict[str, Any]) -> tuple[dict[str, Any], list[Event]]:
        host = {k: v for k, v in state.items()} | {"copied": True}
        copies.append(host)
        return host, [Event(i) for i in range(5)]

    saved: list[dict[str, Any]] = []
    real_save = writer_module.checkpoint.save

    def save(run_dir: Path, state: dict[str, Any], *args: Any, **kwargs: Any) -> Path:
        saved.append(state)
        return real_save(run_dir, {k: v for k, v in state.items() if k != "copied"}, *args, **kwargs)

    monkeypatch.setattr(writer_module, "on_gpu", lambda state: True)
    monkeypatch.setattr(writer_module.checkpoint, "save", save)
    ckpt = AsyncCheckpointer(tmp_path, keep=3, enabled=False)
    monkeypatch.setattr(ckpt._snap, "copy", copy)
    assert ckpt.save(small_state(3)) == tmp_path / "checkpoints" / "step-3.pt"
    assert waits == [4] and len(copies) == 1 and len(saved) == 1 and saved[0] is copies[0]


def test_writer_failure_surfaces_on_the_next_poll_as_one_line(tmp_path: Path, writer: str) -> None:
    """The checkpoint directory cannot be created (a file is in its way): the writer's error is kept
    and raised by the next poll() as checkpoint.CheckpointError, once."""
    (tmp_path / "checkpoints").write_text("not a directory")
    ckpt = AsyncCheckpointer(tmp_path, keep=3, writer=writer)
    ckpt.save(small_state(4))
    ckpt._write.join()  # the write is over (failed); poll must report it without blocking
    assert ckpt.failed
    with pytest.raises(checkpoint.CheckpointError) as err:
        ckpt.poll()
    message = str(err.value)
    assert "\n" not in message and "step-4.pt" in message and "previous checkpoints are intact" in message
    assert not ckpt.failed and not ckpt.in_flight
    ckpt.close()  # already raised: nothing more to say


def test_close_waits_for_the_write(tmp_path: Path, writer: str) -> None:
    ckpt = AsyncCheckpointer(tmp_path, keep=3, writer=writer)
    ckpt.save({**small_state(9), "big": torch.rand(4 * 2**20)})  # 16 MiB: the write takes a while
    ckpt.close()
    assert checkpoint.load_latest(tmp_path)["step"] == 9 and not list((tmp_path / "checkpoints").glob(".*tmp*"))


def test_config_key_is_checkpoint_async() -> None:
    """``async`` is a Python keyword: the field is ``async_save``, the key users type is ``checkpoint.async``."""
    assert config.load(None).checkpoint.async_save is True  # on by default
    assert config.load(None, ["checkpoint.async=false"]).checkpoint.async_save is False
    assert config.from_dict({"checkpoint": {"async": False}}).checkpoint.async_save is False
    assert config.load(None).to_dict()["checkpoint"]["async"] is True
    with pytest.raises(config.ConfigError, match=r"did you mean 'checkpoint.async'"):
        config.load(None, ["checkpoint.async_save=false"])
    with pytest.raises(config.ConfigError, match=r"checkpoint.async in the command line: expected true or false"):
        config.load(None, ["checkpoint.async=maybe"])


# ---------------------------------------------------------------- real processes: the worker


class Worker:
    """``python -m ddp_slurm.bench.ckpt_worker`` (or a torchrun of it), its JSON events read as they come."""

    def __init__(self, run_dir: Path, *args: str, nproc: int = 1, limit_fsize: int | None = None) -> None:
        cmd = [sys.executable, "-m", "ddp_slurm.bench.ckpt_worker", "--run-dir", str(run_dir), *args]
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
            cmd += ["-m", "ddp_slurm.bench.ckpt_worker", "--run-dir", str(run_dir), *args]

        def limit() -> None:
            if limit_fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit_fsize, limit_fsize))

        self.proc = subprocess.Popen(
            cmd,
            env=base_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=limit,
        )
        self.events: list[dict[str, Any]] = []

    def until(self, predicate, timeout: float = 120) -> dict[str, Any]:
        """Read events until one satisfies ``predicate``; return it."""
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                event = json.loads(line)
                self.events.append(event)
                if predicate(event):
                    return event
        raise AssertionError(f"event not seen; events: {self.events}; stderr: {self.finish()[1][-2000:]}")

    def finish(self, timeout: float = 180) -> tuple[int, str]:
        out, err = self.proc.communicate(timeout=timeout)
        self.events += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        return self.proc.returncode, err

    def signal_ranks(self, sig: int) -> None:
        """Every rank (torchrun's workers, not its agent), as Slurm signals the tasks of a step."""
        for pid in {e["pid"] for e in self.events if e["event"] == "ready"}:
            os.kill(pid, sig)


def run_to_end(run_dir: Path, *args: str, nproc: int = 1) -> list[dict[str, Any]]:
    w = Worker(run_dir, *args, nproc=nproc)
    code, err = w.finish()
    assert code == 0, err
    return w.events


def assert_same_state(a: Path, b: Path) -> None:
    sa, sb = checkpoint.load_latest(a), checkpoint.load_latest(b)
    assert sa is not None and sb is not None and sa["step"] == sb["step"] and sa["finished"] and sb["finished"]
    ta, tb = dict(checkpoint._tensors(sa)), dict(checkpoint._tensors(sb))
    assert ta.keys() == tb.keys() and len(ta) > 10
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


# Sizes: 48 MiB of state takes this machine's disk a good fraction of a second to hash, write and
# fsync, while a step takes milliseconds: a signal sent right after a save begins lands mid-write.
ARGS = ["--state-mb", "48", "--steps", "60", "--every", "10", "--keep", "10"]


@pytest.mark.parametrize("nproc, writer", [(1, "thread"), (2, "thread"), (1, "process")])
def test_stop_signal_mid_write_waits_exits_75_and_resume_is_bit_identical(
    tmp_path: Path, nproc: int, writer: str
) -> None:
    """SIGUSR2 while the step-20 write is in flight (to every rank, as Slurm does): the stop step is
    saved (superseding the step-20 write) and durable before exit 75, the newest checkpoint is that
    stop step and valid, the relaunch resumes it, and the end state equals an uninterrupted run's."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    args = [*ARGS, "--state-mb", "128"]  # a write of a few tenths of a second: the signal lands inside it
    run_to_end(whole, *args, nproc=nproc)

    w = Worker(parts, *args, "--step-sleep", "0.02", "--writer", writer, nproc=nproc)
    for _ in range(nproc):
        w.until(lambda e: e["event"] == "ready")
    begin = w.until(lambda e: e["event"] == "begin" and e["step"] == 20)
    w.until(lambda e: e["event"] == "handed" and e["step"] == 20)  # training goes on, the write is in flight
    sent = time.monotonic()  # the ranks see it after their next step (--step-sleep): a newer step than 20
    w.signal_ranks(signal.SIGUSR2)
    code, err = w.finish()
    if nproc == 1:
        assert code == EXIT_STOPPED, err
    else:  # torchrun exits 1 when its workers do not exit 0; its summary names each rank's code
        assert err.count(f"exitcode  : {EXIT_STOPPED}") == nproc, err
    durable = {e["step"]: e["t"] for e in w.events if e["event"] == "durable"}
    # mid-write: after it began and before it was durable (or never, when the stop cancelled it)
    assert begin["t"] < sent < durable.get(20, float("inf")), (
        f"the signal came {sent - durable[20]:.3f} s after step 20 was durable"
    )
    [stopped] = {e["step"] for e in w.events if e["event"] == "stopped"}
    # The stop step itself was made durable before exit: a newer step than 20, whose write superseded
    # step 20's (or, if this process was slow to go on after the save, step 20 itself, the loop's rule
    # for a signal that comes during a save).
    assert 20 <= stopped < 60 and stopped in durable
    newest = checkpoint.latest(parts)
    assert newest is not None and newest[1]["step"] == stopped and not newest[1]["finished"]
    assert not list((parts / "checkpoints").glob(".*tmp*"))

    events = run_to_end(parts, *args, nproc=nproc)
    assert [e["step"] for e in events if e["event"] == "resumed"][0] == stopped
    assert_same_state(whole, parts)


def test_sigkill_mid_write_leaves_the_previous_checkpoint_newest_valid(tmp_path: Path) -> None:
    """SIGKILL while the step-20 temporary file is being written: step-10 stays the newest valid
    checkpoint, no step-20 file exists, and the relaunch resumes from 10 and ends bit-identical."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_to_end(whole, *ARGS)
    w = Worker(parts, *ARGS, "--state-mb", "160", "--step-sleep", "0.02")
    w.until(lambda e: e["event"] == "ready")
    w.until(lambda e: e["event"] == "begin" and e["step"] == 20)
    folder, deadline = parts / "checkpoints", time.monotonic() + 60
    while not list(folder.glob(".step-20.pt.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert list(folder.glob(".step-20.pt.tmp-*")), "the step-20 write never started"
    w.signal_ranks(signal.SIGKILL)
    w.finish()
    assert [s for s, _ in checkpoint.list_checkpoints(parts)] == [10]
    assert checkpoint.latest(parts)[1]["step"] == 10

    events = run_to_end(parts, *ARGS, "--state-mb", "160")
    assert [e["step"] for e in events if e["event"] == "resumed"] == [10]
    assert not list(folder.glob(".*tmp*"))
    whole160 = tmp_path / "whole160"
    run_to_end(whole160, *ARGS, "--state-mb", "160")
    assert_same_state(whole160, parts)


def test_writer_failure_stops_training_with_one_line(tmp_path: Path) -> None:
    """Files may not grow past 4 MiB (RLIMIT_FSIZE: a full disk's EFBIG): the first background write
    fails, the process stops at a following step with exit 1 and one line; nothing half-written stays."""
    run_dir = tmp_path / "r"
    w = Worker(
        run_dir, "--state-mb", "16", "--steps", "400", "--every", "10", "--step-sleep", "0.01", limit_fsize=4 << 20
    )
    code, err = w.finish()
    assert code == 1, err
    lines = [x for x in err.splitlines() if "error" in x]
    assert len(lines) == 1 and "cannot write checkpoint" in lines[0] and "step-10.pt" in lines[0], err
    assert "File too large" in lines[0] and "previous checkpoints are intact" in lines[0]
    assert not any(e["event"] in ("finished", "durable") for e in w.events)
    assert checkpoint.list_checkpoints(run_dir) == [] and not list((run_dir / "checkpoints").glob(".*tmp*"))
    begins = [e["step"] for e in w.events if e["event"] == "begin"]
    # stopped at the first step that saw the failure, or at the next save, which waits for it first
    assert begins in ([10], [10, 20]), begins


def test_snapshot_keeps_strides_so_a_resumed_fused_optimizer_sees_its_layout() -> None:
    """A channels_last weight (the cnn's) and its Adam moments must come back channels_last: a fused
    optimizer walks a parameter and its state as flat memory, and a contiguous moment buffer loaded
    beside a channels_last parameter would pair up the wrong elements (resume no longer bit-identical)."""

    weight = torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)
    snap, _ = Snapshotter().copy({"w": weight, "plain": torch.arange(6).view(2, 3).t()})
    assert snap["w"].stride() == weight.stride() and torch.equal(snap["w"], weight)
    assert torch.equal(snap["plain"], torch.arange(6).view(2, 3).t())
