"""Fault injection on this machine: the faults that hit real clusters, injected into real runs.

Each test starts the real commands (``python -m ddp_slurm.train``, torchrun, ``python -m
ddp_slurm.submit``) as processes, injects one fault with real signals, real files and real file
systems, and checks that the job either continues correctly or stops at once with a clear message,
and that no finished work is lost: every checkpoint that existed before the fault is still there,
byte for byte (or superseded by a newer valid one), and at most the steps since the last checkpoint
are redone. The multi-node versions are in tests/cluster/test_faults_cluster.py; docs/faults.md is
the table of faults, outcomes and tests (including those that live in other test files).
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bad_inputs
import helpers
import pytest
import torch
from bad_inputs import Bad
from conftest import Launcher, base_env, skip_or_fail

from ddp_slurm.train import checkpoint, metrics

HOST = socket.gethostname()
TIMEOUT_S = 600.0  # per process: the machine may be shared and slow; never a timing assertion by itself
EVERY = 10  # checkpoint.every_steps of the runs below
# Long enough never to finish during a test (3,900 steps); one metrics row per step, so the last
# step reached before a fault is on record.
LONG = [
    "model.name=mlp",
    "train.epochs=100",
    "train.log_every_steps=1",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep=3",
]
EXIT_STOPPED, EXIT_REQUEUE_CAP = 75, 3


# --------------------------------------------------------------------------- processes
@dataclass
class Proc:
    """One launched command, its output in a log file, in its own session (killed as a group)."""

    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def fail(self, why: str) -> None:
        pytest.fail(f"{why}\n--- output of {' '.join(map(str, self.popen.args))}\n{self.text()[-8000:]}")

    def wait(self, timeout: float = TIMEOUT_S) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"still running after {timeout:.0f} s")
            raise  # not reached

    def until(self, what: str, ready: Callable[[], bool], poll_s: float = 0.005) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            if self.popen.poll() is not None:
                self.fail(f"exited {self.popen.returncode} before {what}")
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what}")
            time.sleep(poll_s)

    def workers(self, count: int) -> dict[int, int]:
        """torchrun's workers: rank -> pid (read from each child's environment)."""

        def kids() -> list[int]:
            out: list[int] = []
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                try:
                    out += [int(x) for x in (task / "children").read_text().split()]
                except OSError:
                    pass
            return out

        self.until(
            f"{count} torchrun workers", lambda: len(kids()) == count and all("RANK" in environ_of(k) for k in kids())
        )
        return {int(environ_of(k)["RANK"]): k for k in kids()}


def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """``start(cmd, env=None, cwd=tmp_path) -> Proc``; whatever is still running at the end is killed."""
    started: list[Proc] = []

    def launch(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Proc:
        log = tmp_path / f"launch-{len(started)}.log"
        proc = Proc(Launcher(cwd or tmp_path).popen(cmd, env=env or base_env(), log=log), log)
        started.append(proc)
        return proc

    yield launch
    for proc in started:
        if proc.popen.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: torchrun's workers too
            proc.popen.wait()


def leftovers(root: Path) -> list[str]:
    """Live processes (not zombies) working inside ``root``: what a fault must not leave behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (cwd == str(root) or cwd.startswith(f"{root}/")) and state != "Z":
            found.append(f"pid {entry.name}: {cmd[:200]}")
    return found


def assert_nothing_left(root: Path) -> None:
    deadline = time.monotonic() + 30  # the kernel may take a moment to reap what just exited
    while leftovers(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(root), leftovers(root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """torchrun's variables set by hand: each rank a separate, directly signalled process."""
    return base_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        **extra,
    )


# --------------------------------------------------------------------------- run directories
def rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return list(metrics.read(path)) if path.exists() else []


def last_train_step(run_dir: Path) -> int:
    return max((r["step"] for r in rows(run_dir) if r["kind"] == "train"), default=0)


def lost_bytes(before: dict[str, tuple[int, int, str]], run_dir: Path) -> int:
    """Bytes of checkpoints from ``before`` that are now gone or changed. A file may only be gone
    because a newer valid checkpoint pruned it; a changed file is always a loss."""
    now = helpers.checkpoint_files(run_dir)
    newest_valid = -1
    for step, path in checkpoint.list_checkpoints(run_dir):
        try:
            checkpoint.load(path)
        except ValueError:
            continue
        newest_valid = max(newest_valid, step)
    lost = 0
    for name, (step, size, digest) in before.items():
        if name in now:
            lost += size if now[name][2] != digest else 0
        elif step >= newest_valid:
            lost += size
    return lost


def record(
    record_property: Callable[[str, Any], None],
    before: dict[str, tuple[int, int, str]],
    run_dir: Path,
    steps_redone: int,
    took_s: float | None = None,
) -> None:
    """The figures of a fault for the report (in the JUnit XML): finished work lost, steps to redo."""
    record_property("lost_bytes", lost_bytes(before, run_dir))
    record_property("checkpoint_bytes_before", sum(size for _, size, _ in before.values()))
    record_property("steps_redone", steps_redone)
    if took_s is not None:
        record_property("seconds_to_exit", round(took_s, 1))


def between_checkpoints(run_dir: Path) -> Callable[[], bool]:
    """True once two checkpoints exist and training is a few steps past the newest: the moment to
    inject a fault that costs the steps since the last checkpoint, and nothing else."""

    def ready() -> bool:
        saved = checkpoint.list_checkpoints(run_dir)
        return len(saved) >= 2 and last_train_step(run_dir) >= saved[0][0] + 3

    return ready


def temporaries(run_dir: Path) -> list[Path]:
    folder = checkpoint.checkpoint_dir(run_dir)
    return sorted(folder.glob(".step-*.pt.tmp-*")) if folder.is_dir() else []


def error_lines(text: str, rank: int = 0) -> list[str]:
    return [line for line in text.splitlines() if re.match(rf"\d\d:\d\d:\d\d ERROR \[rank {rank} ", line)]


def wait_resumed(proc: Proc, run_dir: Path, launches_before: int) -> dict[str, Any]:
    """Wait for the start row of a relaunch (``launches_before`` start rows were there already)."""
    starts = lambda: [r for r in rows(run_dir) if r["kind"] == "start"]  # noqa: E731
    proc.until("the relaunch's start row", lambda: len(starts()) > launches_before)
    return starts()[launches_before]


def stop_and_check(proc: Proc, run_dir: Path) -> None:
    """SIGUSR2 to a (single-process) launch that is training: exit 75 with a valid checkpoint."""
    os.kill(proc.pid, signal.SIGUSR2)  # the handler is in place: it is installed before the start row
    if proc.wait() != EXIT_STOPPED:
        proc.fail(f"exit {proc.popen.returncode}, expected {EXIT_STOPPED}")
    stop = [r for r in rows(run_dir) if r["kind"] == "stop"][-1]
    assert checkpoint.load_latest(run_dir)["step"] == stop["step"]


# =========================================================================== 1. a rank killed mid-step
def test_rank_killed_mid_step_is_named_and_the_run_resumes(tmp_path: Path, start, record_property) -> None:
    """torchrun, 2 ranks, SIGKILL to rank 1 while training: rank 0 says which rank was lost (host and
    pid) in one line, everything exits within dist.timeout_s + 30 s, nothing is left running, every
    checkpoint is intact and a relaunch resumes from the newest."""
    launcher, run_dir = Launcher(tmp_path), tmp_path / "runs" / "killed"
    args = [*LONG, "dist.timeout_s=30", "run.name=killed"]
    run = start(launcher.cmd_torchrun(2, *args))
    victim = run.workers(2)[1]
    run.until("training between two checkpoints", between_checkpoints(run_dir))
    before = helpers.checkpoint_files(run_dir)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    code = run.wait()
    took = time.monotonic() - killed
    text = run.text()

    assert code != 0, text
    ours = [line for line in error_lines(text) if "lost rank" in line]
    assert len(ours) == 1, text[-6000:]
    assert re.search(
        rf"lost rank 1 \(host {re.escape(HOST)}, pid {victim}\): no heartbeat for \d+ s; {helpers.LOST_FOUND}",
        ours[0],
    ), ours[0]
    assert "ddp_slurm/train/" not in text, "the survivor printed a traceback instead of (or besides) its line"
    assert took <= 30 + 30, f"the survivor took {took:.0f} s to exit after the kill (dist.timeout_s=30)"
    assert_nothing_left(tmp_path)

    saved = checkpoint.load_latest(run_dir)
    record(record_property, before, run_dir, last_train_step(run_dir) - saved["step"], took)
    assert lost_bytes(before, run_dir) == 0
    assert 0 <= last_train_step(run_dir) - saved["step"] <= EVERY  # only the steps since the last checkpoint
    again = start(launcher.cmd_train(*args))
    resumed = wait_resumed(again, run_dir, 1)
    assert resumed["resumed"] is True and resumed["step"] == saved["step"], resumed
    stop_and_check(again, run_dir)


def test_hung_rank_is_named_after_the_collective_timeout(tmp_path: Path, start, record_property) -> None:
    """A rank that stops answering without closing its sockets (SIGSTOP: a frozen or unplugged node):
    rank 0 fails after dist.timeout_s, names the silent rank, and exits within dist.timeout_s + 30 s."""
    launcher, run_dir, port = Launcher(tmp_path), tmp_path / "runs" / "hung", free_port()
    args = [*LONG, "dist.timeout_s=20", "run.name=hung"]
    ranks = [start(launcher.cmd_train(*args), env=rank_env(r, 2, port)) for r in (0, 1)]
    ranks[0].until("training between two checkpoints", between_checkpoints(run_dir))
    before = helpers.checkpoint_files(run_dir)
    os.kill(ranks[1].pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        code = ranks[0].wait()
        took = time.monotonic() - frozen
    finally:
        os.kill(ranks[1].pid, signal.SIGKILL)  # also ends a stopped process
        ranks[1].popen.wait()
    text = ranks[0].text()
    assert code == 1, text[-4000:]
    [line] = [line for line in error_lines(text) if "lost rank" in line]
    assert re.search(
        rf"lost rank 1 \(host {re.escape(HOST)}, pid {ranks[1].pid}\): no heartbeat for \d+ s; "
        # named by the stall check before the backend's timeout, or by the collective that timed out
        rf"({helpers.FOUND_BY_STALL}|{helpers.FOUND_BY_COLLECTIVE}.*([Tt]imed out|timeout))",
        line,
    ), line
    assert took <= 20 + 30, f"rank 0 took {took:.0f} s to give up (dist.timeout_s=20)"
    record(record_property, before, run_dir, last_train_step(run_dir) - checkpoint.load_latest(run_dir)["step"], took)
    assert lost_bytes(before, run_dir) == 0
    assert_nothing_left(tmp_path)


# =========================================================================== 3. unusable checkpoints
SHORT = [
    "model.name=mlp",
    "train.epochs=1",
    "train.max_steps=30",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep=3",
    "train.log_every_steps=5",
    "run.name=base",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding runs/base: 30 steps, checkpoints at steps 10, 20 and 30 (finished)."""
    cwd = tmp_path_factory.mktemp("finished")
    res = Launcher(cwd).run(Launcher(cwd).cmd_train(*SHORT), timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    assert [s for s, _ in checkpoint.list_checkpoints(cwd / "runs" / "base")] == [30, 20, 10]
    return cwd


def copy_run(finished_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished_run / "runs", tmp_path / "runs")
    return tmp_path / "runs" / "base"


def flip_a_bit(data: bytes) -> bytes:
    i = len(data) // 2  # inside the tensor data, which is most of the file
    return data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :]


def change_a_plain_value(data: bytes) -> bytes:
    """What a flipped bit in the pickled metadata does: the file loads, one number is wrong."""
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    state["step_in_epoch"] += 1  # would resume at the wrong sample
    out = io.BytesIO()
    torch.save(state, out)
    return out.getvalue()


CORRUPT: dict[str, Callable[[bytes], bytes]] = {
    "bit-flipped": flip_a_bit,
    "empty": lambda data: b"",
    "not a checkpoint": lambda data: b"step,loss\n30,0.12\n",
    "a plain value changed": change_a_plain_value,
    # "truncated": tests/test_resume.py::test_writer_killed_mid_save_leaves_previous_checkpoint relaunches over one
}


@pytest.mark.parametrize("how", sorted(CORRUPT))
def test_unusable_newest_checkpoint_is_skipped_and_the_one_before_used(
    finished_run: Path, tmp_path: Path, how: str
) -> None:
    run_dir = copy_run(finished_run, tmp_path)
    newest = run_dir / "checkpoints" / "step-30.pt"
    newest.write_bytes(CORRUPT[how](newest.read_bytes()))
    older = {k: v for k, v in helpers.checkpoint_files(run_dir).items() if k != newest.name}

    res = Launcher(tmp_path).run(Launcher(tmp_path).cmd_train(*SHORT), timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    assert re.search(rf"WARNING \[rank 0 {re.escape(HOST)}\] skipping checkpoint \S*step-30\.pt: \S", res.stderr), (
        res.stderr
    )
    resumed = [r for r in rows(run_dir) if r["kind"] == "start"][-1]
    assert resumed["resumed"] is True and resumed["step"] == 20, resumed
    assert lost_bytes(older, run_dir) == 0
    state = checkpoint.load_latest(run_dir)
    assert state["step"] == 30 and state["finished"]


def test_all_checkpoints_unusable_stops_instead_of_starting_over(finished_run: Path, tmp_path: Path) -> None:
    run_dir = copy_run(finished_run, tmp_path)
    for (_, path), corrupt in zip(checkpoint.list_checkpoints(run_dir), CORRUPT.values()):
        path.write_bytes(corrupt(path.read_bytes()))
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}

    res = Launcher(tmp_path).run(Launcher(tmp_path).cmd_train(*SHORT), timeout=TIMEOUT_S)
    assert res.returncode == 1, res.stderr
    [line] = error_lines(res.stderr)
    assert re.search(
        r"no usable checkpoint in \S+ \(step-30\.pt, step-20\.pt, step-10\.pt all failed to load\); "
        r"refusing to start over",
        line,
    ), line
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == files
    assert "Traceback" not in res.stderr


# Whole, sealed checkpoints that do not fit the run (the task's configure_optimizer edited between requeues,
# another program's state): each used to crash every relaunch (a traceback, or a segfault for a wrong-shaped
# optimizer state) or, for a foreign schedule, to be resumed silently with another result.
def _another_schedule(state: dict[str, Any]) -> None:
    lrs = state["scheduler"]["base_lrs"]
    state["scheduler"] = {"base_lrs": lrs, "last_epoch": state["step"], "lr_lambdas": [None], "_step_count": 1}


MISFITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "another optimizer": (
        lambda s: s["optimizer"]["param_groups"][0].update(momentum=0.9, dampening=0, nesterov=True),
        "another optimizer",
    ),
    "optimizer state of the wrong shape": (
        lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(3)),
        "has shape [3]",
    ),
    "another schedule": (_another_schedule, "another schedule's"),
    "no step_in_epoch": (lambda s: s.pop("step_in_epoch"), "no 'step_in_epoch' in it"),
    "garbage step_in_epoch": (lambda s: s.update(step_in_epoch="7"), "its step_in_epoch is not a count ('7')"),
    "garbage RNG state": (lambda s: s["rng"][0].update(torch=torch.zeros(3, dtype=torch.uint8)), "RNG streams"),
    "garbage best": (lambda s: s.update(best="high"), "its best is not a number or null ('high')"),
}


def reseal(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """``path`` rewritten with ``change`` applied, sealed as the program seals: it passes every file check."""
    state = checkpoint.load(path)
    change(state)
    path.unlink()
    checkpoint.save(path.parent.parent, state, keep=100)
    checkpoint.load(path)  # whole and sealed


@pytest.mark.parametrize("how", sorted(MISFITS))
def test_checkpoint_that_does_not_fit_is_skipped_before_anything_is_loaded(
    finished_run: Path, tmp_path: Path, how: str
) -> None:
    run_dir = copy_run(finished_run, tmp_path)
    change, says = MISFITS[how]
    reseal(run_dir / "checkpoints" / "step-30.pt", change)
    res = Launcher(tmp_path).run(Launcher(tmp_path).cmd_train(*SHORT), timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    [warning] = [line for line in res.stderr.splitlines() if "skipping checkpoint" in line]
    assert re.search(r"skipping checkpoint \S*step-30\.pt: ", warning) and says in warning, warning
    resumed = [r for r in rows(run_dir) if r["kind"] == "start"][-1]
    assert resumed["resumed"] is True and resumed["step"] == 20, resumed
    assert checkpoint.load_latest(run_dir)["finished"]


def test_no_checkpoint_fits_exits_2_naming_the_file_and_what_does_not_fit(finished_run: Path, tmp_path: Path) -> None:
    run_dir = copy_run(finished_run, tmp_path)
    for _, path in checkpoint.list_checkpoints(run_dir):
        reseal(path, MISFITS["optimizer state of the wrong shape"][0])
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    res = Launcher(tmp_path).run(Launcher(tmp_path).cmd_train(*SHORT), timeout=TIMEOUT_S)
    assert res.returncode == 2, res.stderr
    [line] = error_lines(res.stderr)
    assert re.search(
        r"no checkpoint fits this run: \S*step-30\.pt: its optimizer state exp_avg of parameter 0 has shape \[3\]",
        line,
    ), line
    assert "Traceback" not in res.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == files


# =========================================================================== 4. unwritable / full disk
@pytest.fixture
def mounts() -> Iterator[Callable[..., None]]:
    """``mount(*args)``: a real mount (root only), undone at the end whatever happens."""
    done: list[str] = []

    def mount(*args: str) -> None:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            skip_or_fail("mounting a small or read-only file system needs root and mount(8)")
        res = subprocess.run(["mount", *args], capture_output=True, text=True)
        if res.returncode != 0:
            skip_or_fail(f"mount {' '.join(args)} failed: {res.stderr.strip()}")
        if "remount" not in ",".join(args):
            done.append(args[-1])

    yield mount
    for target in reversed(done):
        if subprocess.run(["umount", target], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", target], capture_output=True)


def small_disk(finished_run: Path, tmp_path: Path, mounts) -> Path:
    """A tmpfs with room for two and a half checkpoints of the finished run's size, mounted at ``tmp_path/disk``."""
    size = (finished_run / "runs" / "base" / "checkpoints" / "step-10.pt").stat().st_size
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", f"size={(5 * size // 2 + 64 * 1024) // 1024}k", "tmpfs", str(disk))
    return disk


def test_disk_full_during_a_save_stops_with_the_previous_checkpoints_intact(
    finished_run: Path, tmp_path: Path, mounts, record_property
) -> None:
    """The run directory on a file system with room for two checkpoints: the third save fails, the
    run stops right there with one clear line (it does not train on without a safety net), the two
    checkpoints are intact; once there is room, the relaunch resumes from the second."""
    disk = small_disk(finished_run, tmp_path, mounts)
    run_dir = disk / "runs" / "full"
    args = [
        "model.name=mlp",
        "train.epochs=2",
        "train.max_steps=50",
        f"checkpoint.every_steps={EVERY}",
        "train.log_every_steps=5",
        f"run.output_root={disk / 'runs'}",
        "run.name=full",
    ]
    launcher = Launcher(tmp_path)

    res = launcher.run(launcher.cmd_train(*args), timeout=TIMEOUT_S)
    assert res.returncode == 1, res.stderr
    [line] = error_lines(res.stderr)
    assert re.search(
        r"cannot write checkpoint \S*step-30\.pt: No space left on device; previous checkpoints "
        r"are intact",
        line,
    ), line
    assert [s for s, _ in checkpoint.list_checkpoints(run_dir)] == [20, 10] and not temporaries(run_dir)
    assert last_train_step(run_dir) == 30  # stopped at the failed save: no step 35
    before = helpers.checkpoint_files(run_dir)
    assert all(checkpoint.load(run_dir / "checkpoints" / name) for name in before)

    mounts("-o", "remount,size=64m", str(disk))
    res = launcher.run(launcher.cmd_train(*args), timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    assert [r for r in rows(run_dir) if r["kind"] == "start"][-1]["step"] == 20
    record(record_property, before, run_dir, 30 - 20)
    assert lost_bytes(before, run_dir) == 0
    assert checkpoint.load_latest(run_dir)["step"] == 50


@pytest.mark.parametrize("writes", ["sync", "async"])
def test_disk_full_during_a_sharded_save_names_the_reason(
    finished_run: Path, tmp_path: Path, mounts, writes: str
) -> None:
    """Audit break 16: under fsdp a full disk read ``CheckpointException ranks:dict_keys([0])``; the reason
    inside it is what the line says now, and the committed checkpoints are intact."""
    disk = small_disk(finished_run, tmp_path, mounts)
    run_dir = disk / "runs" / "full"
    args = [
        "model.name=mlp",
        "dist.strategy=fsdp",
        f"checkpoint.async={writes == 'async'}",
        "train.max_steps=50",
        f"checkpoint.every_steps={EVERY}",
        f"run.output_root={disk / 'runs'}",
        "run.name=full",
    ]
    res = Launcher(tmp_path).run(Launcher(tmp_path).cmd_train(*args), timeout=TIMEOUT_S)
    assert res.returncode == 1, res.stderr
    [line] = error_lines(res.stderr)
    assert re.search(
        r"cannot write checkpoint \S*step-\d+: No space left on device; previous checkpoints are intact", line
    ), line
    assert "CheckpointException" not in res.stderr
    found = checkpoint.latest(run_dir)
    assert found is not None and found[1]["step"] >= EVERY  # the newest committed one is whole


def test_read_only_run_directory_stops_with_one_line(finished_run: Path, tmp_path: Path, mounts) -> None:
    """checkpoints/ turned read-only under an interrupted run (a read-only bind mount): the relaunch
    resumes, fails at its first save with one clear line, and changes nothing on disk. The whole run
    directory read-only: refused at once, also in one line."""
    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "checkpoints" / "step-30.pt").unlink()  # as if stopped after step 20
    folder = str(run_dir / "checkpoints")
    mounts("--bind", folder, folder)
    mounts("-o", "remount,bind,ro", folder)
    before = helpers.checkpoint_files(run_dir)

    res = Launcher(tmp_path).run(Launcher(tmp_path).cmd_train(*SHORT), timeout=TIMEOUT_S)
    assert res.returncode == 1, res.stderr
    [line] = error_lines(res.stderr)
    assert re.search(
        r"cannot write checkpoint \S*step-30\.pt: Read-only file system; previous checkpoints "
        r"are intact",
        line,
    ), line
    assert helpers.checkpoint_files(run_dir) == before
    assert [r for r in rows(run_dir) if r["kind"] == "start"][-1]["step"] == 20

    # The whole run directory read-only: refused before any work, in one line.
    mounts("--bind", str(run_dir), str(run_dir))
    mounts("-o", "remount,bind,ro", str(run_dir))
    res = Launcher(tmp_path).run(Launcher(tmp_path).cmd_train(*SHORT), timeout=TIMEOUT_S)
    assert res.returncode == 1, res.stderr
    [line] = error_lines(res.stderr)
    assert "cannot write the run directory runs/base: Read-only file system" in line, line
    assert "Traceback" not in res.stderr and helpers.checkpoint_files(run_dir) == before


def test_run_directory_deleted_mid_run_stops_with_one_line_and_is_not_recreated(tmp_path: Path, start) -> None:
    """The run directory removed under a training run (rm -rf, a cleanup script): the next save stops the run
    with one line; nothing is recreated in its place (it used to come back 0755 without config, metrics or
    lock, and the run ended "finished")."""
    launcher, run_dir = Launcher(tmp_path), tmp_path / "runs" / "gone"
    run = start(launcher.cmd_train(*LONG, "run.name=gone"))
    run.until("a checkpoint", lambda: len(checkpoint.list_checkpoints(run_dir)) >= 1)
    for _ in range(20):  # rm -rf racing the run: a line appended meanwhile brings metrics.jsonl back, once
        shutil.rmtree(run_dir, ignore_errors=True)
        if not run_dir.exists():
            break
    assert run.wait() == 1, run.text()
    [line] = error_lines(run.text())
    assert re.search(r"cannot write checkpoint \S*step-\d+\.pt: the run directory \S*runs/gone is gone", line), line
    assert "Traceback" not in run.text()
    assert not run_dir.exists()


# =========================================================================== 5. two launches, one run
def test_second_launch_on_a_live_run_refuses_and_a_killed_run_does_not_block(
    tmp_path: Path, start, record_property
) -> None:
    launcher, run_dir = Launcher(tmp_path), tmp_path / "runs" / "busy"
    args = [*LONG, "run.name=busy"]
    first = start(launcher.cmd_train(*args))
    first.until("a checkpoint", lambda: len(checkpoint.list_checkpoints(run_dir)) >= 1)
    config_before = (run_dir / "config.yaml").read_bytes()

    second = start(launcher.cmd_train(*args))
    assert second.wait() == 2, second.text()
    [line] = error_lines(second.text())
    assert f"run directory runs/busy is in use by another launch (pid {first.pid} on {HOST})" in line, line
    assert first.popen.poll() is None, "the refused launch disturbed the running one"
    assert len([r for r in rows(run_dir) if r["kind"] == "start"]) == 1
    assert (run_dir / "config.yaml").read_bytes() == config_before

    os.killpg(first.pid, signal.SIGKILL)  # crashes without releasing anything
    first.popen.wait()
    before = helpers.checkpoint_files(run_dir)
    third = start(launcher.cmd_train(*args))
    resumed = wait_resumed(third, run_dir, 1)
    assert resumed["resumed"] is True and resumed["step"] == max(s for s, _, _ in before.values())
    stop_and_check(third, run_dir)
    record(record_property, before, run_dir, 0)  # SIGKILL came right after a checkpoint was seen: 0 to few steps
    assert lost_bytes(before, run_dir) == 0


# =========================================================================== 6. bad inputs
TORCHRUN_3 = (
    ("RANK", "0"),
    ("WORLD_SIZE", "3"),
    ("LOCAL_RANK", "0"),
    ("LOCAL_WORLD_SIZE", "3"),
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29400"),
)
SRUN_STEP = (
    ("SLURM_JOB_ID", "77"),
    ("SLURM_STEP_ID", "0"),
    ("SLURM_PROCID", "0"),
    ("SLURM_LOCALID", "0"),
    ("SLURM_NODEID", "0"),
    ("SLURM_NTASKS", "2"),
    ("SLURM_NNODES", "2"),
    ("SLURM_TASKS_PER_NODE", "1(x2)"),
)
BAD_INPUTS: dict[str, Bad] = {
    "yaml-indentation": Bad(
        ("--config", "job.yaml"), ("job.yaml is not valid YAML at line 3",), file="train:\n  epochs: 3\n   lr: 0.1\n"
    ),
    "yaml-a-list": Bad(("--config", "job.yaml"), ("expected a mapping of sections",), file="- train\n- epochs\n"),
    "section-not-a-mapping": Bad(
        ("--config", "job.yaml"), ("section 'train'", "expected a mapping"), file="train: 5\n"
    ),
    "unknown-section": Bad(
        ("--config", "job.yaml"), ("unknown config section 'optim'", "job.yaml"), file="optim:\n  lr: 0.1\n"
    ),
    "unknown-key-in-file": Bad(
        ("--config", "job.yaml"), ("'train.epoch'", "job.yaml", "did you mean"), file="train:\n  epoch: 3\n"
    ),
    "wrong-type-in-file": Bad(
        ("--config", "job.yaml"), ("train.lr in job.yaml", "a number", "'fast'"), file="train:\n  lr: fast\n"
    ),
    "negative-batch-in-file": Bad(
        ("--config", "job.yaml"),
        ("train.global_batch_size in job.yaml", ">= 1"),
        file="train:\n  global_batch_size: -128\n",
    ),
    "missing-config": Bad(("--config", "nowhere.yaml"), ("config file nowhere.yaml not found",)),
    "config-is-a-directory": Bad(("--config", "."), ("config file . cannot be read",)),
    "zero-epochs": Bad(("train.epochs=0",), ("train.epochs", ">= 1")),
    "negative-timeout": Bad(("dist.timeout_s=-5",), ("dist.timeout_s", "> 0")),
    "unknown-key-override": Bad(("train.learning_rate=0.1",), ("unknown config key 'train.learning_rate'",)),
    "override-without-value": Bad(("train.epochs",), ("bad override 'train.epochs'", "KEY=VALUE")),
    "override-without-key": Bad(("=3",), ("bad override '=3'",)),
    "override-empty-value": Bad(("train.epochs=",), ("train.epochs", "an integer", "None")),
    "unknown-model": Bad(("model.name=resnet",), ("model.name", "'mlp'", "'cnn'")),
    "unknown-data-source": Bad(("data.source=cifar",), ("data.source", "'sample'", "'mnist'")),
    "batch-not-divisible": Bad(
        ("train.global_batch_size=128",), ("not divisible by the world size 3",), env=TORCHRUN_3
    ),
    "unknown-flag": Bad(("--epochs", "3"), ("unrecognized arguments: --epochs",)),
    "flag-without-value": Bad(("--config",), ("argument --config: expected one argument",)),
    "fp16-under-fsdp": Bad(
        ("train.precision=fp16", "dist.strategy=fsdp"), ("train.precision=fp16 runs under dist.strategy=ddp, not fsdp",)
    ),
    "nonsense-node-list": Bad(
        (), ("malformed Slurm host list 'node[3-1]'",), env=SRUN_STEP + (("SLURM_JOB_NODELIST", "node[3-1]"),)
    ),
    "rank-beyond-world": Bad(
        (),
        ("RANK=2 but WORLD_SIZE=2",),
        env=(
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_PORT", "29400"),
        ),
    ),
    "partial-torchrun-env": Bad((), ("LOCAL_RANK", "missing"), env=(("RANK", "0"), ("WORLD_SIZE", "2"))),
    "port-not-a-port": Bad((), ("MASTER_PORT=70000",), env=TORCHRUN_3[:4] + (("MASTER_PORT", "70000"),)),
    "many-tasks-without-srun": Bad(
        (), ("not in a job step", "srun"), env=(("SLURM_JOB_ID", "77"), ("SLURM_NTASKS", "4"))
    ),
    "submit-zero-nodes": Bad(
        ("--dry-run", "--nodes", "0"), ("--nodes", "expected an integer >= 1"), module="ddp_slurm.submit"
    ),
    "submit-time-not-a-number": Bad(
        ("--dry-run", "--time", "abc"), ("--time", "is not a Slurm time"), module="ddp_slurm.submit"
    ),
    "submit-zero-cpus": Bad(
        ("--dry-run", "--cpus-per-task", "0"), ("--cpus-per-task", ">= 1"), module="ddp_slurm.submit"
    ),
    "submit-unknown-cluster": Bad(
        ("--cluster", "nowhere"), ("--cluster", "invalid choice", "'nowhere'"), module="ddp_slurm.submit"
    ),
}


BAD_INPUTS.update(bad_inputs.CASES)


def tree(root: Path) -> list[str]:
    """Every path under ``root``, for "nothing created"."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def run_bad(case: Bad, cwd: Path) -> subprocess.CompletedProcess:
    cwd.mkdir()
    if case.file is not None:
        (cwd / "job.yaml").write_text(case.file)
    for rel, content in case.files:
        path = cwd / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == bad_inputs.FIFO:
            os.mkfifo(path)
        elif content == bad_inputs.DIR:
            path.mkdir()
        elif content == bad_inputs.LINK:
            (cwd / "victim.txt").write_text("another user's file\n")
            path.symlink_to(cwd / "victim.txt")
        else:
            path.write_bytes(content)
    for rel, mode in case.modes:
        (cwd / rel).chmod(mode)
    (cwd.parent / f"{cwd.name}.before").write_text("\n".join(tree(cwd)))
    return subprocess.run(
        [sys.executable, "-m", case.module, *case.argv],
        cwd=cwd,
        env=base_env(**dict(case.env)),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def bad_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every bad command line, run at once in parallel (each pays for importing torch)."""
    root = tmp_path_factory.mktemp("bad")
    selected = {  # only the cases this session runs (-k): each torch-importing one costs seconds
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_bad_input_is_refused_in_one_line"
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:  # torch-free cases take a second
        futures = {name: pool.submit(run_bad, BAD_INPUTS[name], root / name) for name in selected}
        return {name: (root / name, f.result()) for name, f in futures.items()}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_refused_in_one_line(bad_results, name: str) -> None:
    cwd, res = bad_results[name]
    lines = res.stderr.strip().splitlines()
    if BAD_INPUTS[name].after_start:  # the logs are up by then: one ERROR line, no traceback
        assert "Traceback" not in res.stderr, res.stderr
        lines = [line for line in lines if " ERROR " in line]
    assert res.returncode == 2, f"exit {res.returncode}\n{res.stderr}"
    assert len(lines) == 1, f"expected one line on stderr:\n{res.stderr}"
    for text in BAD_INPUTS[name].says:
        assert text in lines[0], f"{text!r} missing from {lines[0]!r}"
    assert res.stdout == ""
    before = (cwd.parent / f"{cwd.name}.before").read_text().splitlines()
    assert tree(cwd) == before, "something was created for a refused command"
    if not any(rel.startswith("runs/") for rel, _ in BAD_INPUTS[name].files):
        assert not (cwd / "runs").exists(), "a run directory was created for a refused command"
    assert "starting run" not in res.stderr and "joined" not in res.stderr


# =========================================================================== 7. rendezvous port taken
def test_rendezvous_port_in_use_names_the_port_and_the_way_out(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = launcher.run(launcher.cmd_train(*SHORT), env=rank_env(0, 2, port), timeout=TIMEOUT_S)
    assert res.returncode not in (0, 2, EXIT_STOPPED), res.stderr
    [line] = error_lines(res.stderr)
    assert f"port {port} is already in use on 127.0.0.1; set MASTER_PORT to a free port" in line, line
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def foreign_listener() -> Iterator[int]:
    """A port held by another program that accepts connections and never answers (a stale server)."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed at the end of the test
                return

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in held:
        conn.close()


def test_taken_port_every_rank_gives_up_in_time_with_one_line(tmp_path: Path, start, foreign_listener: int) -> None:
    """Rank 0 cannot listen and says so at once; the other ranks reach the foreign listener and used to wait
    as long as it lived, deaf to SIGTERM: now they give up within dist.timeout_s plus a few seconds, naming
    the port, and a stop signal ends the wait (exit 75, nothing created)."""
    launcher, port, timeout_s = Launcher(tmp_path), foreign_listener, 5
    args = [*SHORT, "train.global_batch_size=60", f"dist.timeout_s={timeout_s}"]
    ranks = [start(launcher.cmd_train(*args), env=rank_env(r, 3, port)) for r in range(3)]
    began = time.monotonic()
    ranks[0].wait(timeout=120)  # it fails at once, after importing torch: by then the others are waiting
    time.sleep(1)
    os.kill(ranks[2].pid, signal.SIGTERM)
    codes = [r.wait(timeout=120) for r in ranks]
    took = time.monotonic() - began
    assert took < timeout_s + 30, f"{took:.0f} s"  # start-up (torch import) plus timeout plus margin, on a busy machine
    assert codes == [1, 1, EXIT_STOPPED], [r.text() for r in ranks]
    [line] = error_lines(ranks[0].text(), 0)
    assert f"port {port} is already in use on 127.0.0.1; set MASTER_PORT to a free port" in line, line
    [line] = error_lines(ranks[1].text(), 1)
    assert re.search(
        rf"rank 1: rendezvous at 127\.0\.0\.1:{port} timed out after {timeout_s} s: something accepts connections "
        rf"on port {port} but does not answer as rank 0's rendezvous store .*set MASTER_PORT to a free port",
        line,
    ), line
    assert "stop signal while waiting for the other ranks" in ranks[2].text(), ranks[2].text()
    assert all("Traceback" not in r.text() for r in ranks)
    assert not (tmp_path / "runs").exists()


# =========================================================================== 8. loss becomes NaN
def test_diverging_loss_stops_at_that_step_and_saves_no_bad_weights(tmp_path: Path) -> None:
    launcher, run_dir = Launcher(tmp_path), tmp_path / "runs" / "nan"
    args = [
        "model.name=mlp",
        "train.optimizer=sgd",
        "train.lr=1e6",
        "train.schedule=constant",
        "train.epochs=1",
        "checkpoint.every_steps=2",
        "checkpoint.keep=100",
        "train.log_every_steps=1",
        "run.name=nan",
    ]
    res = launcher.run(launcher.cmd_train(*args), timeout=TIMEOUT_S)
    assert res.returncode == 1, res.stderr
    [line] = error_lines(res.stderr)
    found = re.search(r"(?:loss is (?:nan|inf|-inf)|weights are not finite) at step (\d+)", line)
    assert found, line
    assert "Traceback" not in res.stderr
    bad_step = int(found[1])
    assert not [r for r in rows(run_dir) if r["kind"] in ("end", "eval") or r["step"] > bad_step]
    saved = checkpoint.list_checkpoints(run_dir)
    assert saved and all(step <= bad_step for step, _ in saved)
    for _, path in saved:  # read raw, not through the validating loader: every float tensor must be finite
        state = torch.load(path, map_location="cpu", weights_only=True)
        for name, t in checkpoint._tensors({"model": state["model"], "optimizer": state["optimizer"]}):
            assert not t.is_floating_point() or torch.isfinite(t).all(), f"{path.name}: {name} is not finite"
    assert checkpoint.load_latest(run_dir)["step"] == max(s for s, _ in saved)


# =========================================================================== 9. stop signals
def torchrun_exit_codes(text: str) -> list[str]:
    return sorted(re.findall(r"^\s+exitcode\s*:\s*(-?\d+)", text, re.M))


def assert_one_clean_stop(run_dir: Path) -> dict[str, Any]:
    stops = [r for r in rows(run_dir) if r["kind"] == "stop"]
    assert len(stops) == 1, rows(run_dir)
    assert not [r for r in rows(run_dir) if r["kind"] == "end"]
    state = checkpoint.load_latest(run_dir)
    assert (state["step"], state["finished"]) == (stops[0]["step"], False)
    assert not temporaries(run_dir)
    return stops[0]


def test_burst_of_stop_signals_to_every_rank_is_one_clean_stop(tmp_path: Path, start, record_property) -> None:
    launcher, run_dir = Launcher(tmp_path), tmp_path / "runs" / "burst"
    run = start(launcher.cmd_torchrun(2, *LONG, "run.name=burst"))
    run.until("a checkpoint", lambda: len(checkpoint.list_checkpoints(run_dir)) >= 1)
    pids = run.workers(2)
    before = helpers.checkpoint_files(run_dir)
    for i in range(60):  # USR2 and TERM, interleaved, to both ranks, for about half a second
        try:
            os.kill(pids[i % 2], signal.SIGTERM if i % 3 == 0 else signal.SIGUSR2)
        except ProcessLookupError:  # that rank has already exited 75
            pass
        time.sleep(0.008)
    run.wait()
    text = run.text()
    assert torchrun_exit_codes(text) == [str(EXIT_STOPPED)] * 2, text[-5000:]
    stop = assert_one_clean_stop(run_dir)
    assert text.count(f"stopped on signal at step {stop['step']} with a checkpoint") == 1
    record(record_property, before, run_dir, 0)
    assert lost_bytes(before, run_dir) == 0
    assert_nothing_left(tmp_path)


def test_stop_signal_during_a_checkpoint_save(tmp_path: Path, start) -> None:
    """Freeze the process while a checkpoint's temporary file exists (mid-save), queue SIGUSR2 and
    SIGTERM, let it continue: the save completes, it is the stop checkpoint, exit 75."""
    launcher, run_dir = Launcher(tmp_path), tmp_path / "runs" / "mid-save"
    run = start(
        launcher.cmd_train(
            "model.name=mlp",
            "train.epochs=100",
            "checkpoint.every_steps=1",
            "checkpoint.keep=3",
            "run.name=mid-save",
            "checkpoint.async=false",  # the synchronous writer; a signal mid background write: test_checkpoint_writer
        )
    )
    run.until("training", lambda: len(checkpoint.list_checkpoints(run_dir)) >= 1)
    for _ in range(200):
        run.until("a save in progress", lambda: bool(temporaries(run_dir)), poll_s=0.0005)
        os.kill(run.pid, signal.SIGSTOP)
        writing = temporaries(run_dir)
        if writing:
            break
        os.kill(run.pid, signal.SIGCONT)  # the save finished before the freeze: try the next one
    else:
        pytest.fail("could not freeze the process inside a checkpoint save in 200 tries")
    step = int(re.match(r"\.step-(\d+)\.pt", writing[0].name)[1])
    os.kill(run.pid, signal.SIGUSR2)
    os.kill(run.pid, signal.SIGTERM)
    os.kill(run.pid, signal.SIGCONT)
    if run.wait() != EXIT_STOPPED:
        run.fail(f"exit {run.popen.returncode}, expected {EXIT_STOPPED}")
    stop = assert_one_clean_stop(run_dir)
    assert stop["step"] == step, (stop, writing)


# =========================================================================== 10. requeue cap
SCONTROL_STUB = '#!/bin/sh\necho "$@" >> "{calls}"\n'


def fake_slurm_job(tmp_path: Path, restart: int) -> tuple[dict[str, str], Path]:
    """A Slurm-job environment (one task, no srun step) whose scontrol only records its calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(SCONTROL_STUB.format(calls=calls))
    (bin_dir / "scontrol").chmod(0o755)
    return base_env(
        SLURM_JOB_ID="4242", SLURM_RESTART_COUNT=str(restart), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    ), calls


def test_requeue_cap_reached_at_the_signal_stops_with_exit_3_and_no_requeue(tmp_path: Path, start) -> None:
    launcher, run_dir = Launcher(tmp_path), tmp_path / "runs" / "capped"
    env, calls = fake_slurm_job(tmp_path, restart=2)
    run = start(launcher.cmd_train(*LONG, "slurm.max_requeues=2", "run.name=capped"), env=env)
    run.until("a checkpoint", lambda: len(checkpoint.list_checkpoints(run_dir)) >= 1)
    os.kill(run.pid, signal.SIGUSR2)
    assert run.wait() == EXIT_REQUEUE_CAP, run.text()
    [line] = error_lines(run.text())
    assert "requeue cap reached (2 requeues, slurm.max_requeues=2): not requeueing" in line, line
    assert not helpers.requeue_calls(calls), "scontrol requeue was called although the cap was reached"
    assert_one_clean_stop(run_dir)


def test_requeue_cap_exceeded_at_start_does_not_train(tmp_path: Path) -> None:
    launcher, run_dir = Launcher(tmp_path), tmp_path / "runs" / "over"
    env, calls = fake_slurm_job(tmp_path, restart=3)
    res = launcher.run(launcher.cmd_train(*SHORT, "slurm.max_requeues=2", "run.name=over"), env=env, timeout=TIMEOUT_S)
    assert res.returncode == EXIT_REQUEUE_CAP, res.stderr
    [line] = error_lines(res.stderr)
    assert "requeue cap reached: restart 3 > slurm.max_requeues=2" in line, line
    assert not helpers.requeue_calls(calls) and not checkpoint.list_checkpoints(run_dir)
    assert not [r for r in rows(run_dir) if r["kind"] == "train"]


# =========================================================================== the watchdog itself
def dogs(world: int, store: Any | None = None) -> list[Any]:
    """One Watchdog per pretend rank, all in this process, sharing one store; quick timings."""
    import torch.distributed as dist

    from ddp_slurm.distributed.watchdog import Watchdog

    store = store if store is not None else dist.HashStore()
    return [
        Watchdog(dist.PrefixStore("test/", store), r, world, "127.0.0.1:4711", interval_s=0.2, grace_s=1.5).start()
        for r in range(world)
    ]


GLOO_ERROR = RuntimeError(
    "[/src/gloo/transport/tcp/pair.cc:545] Read error [10.0.0.2]:4711: Connection reset by "
    "peer. This is typically caused by a remote worker hanging. GLHF!"
)


@pytest.mark.parametrize("world, dead", [(3, [2]), (4, [1, 3])])
def test_watchdog_names_exactly_the_silent_ranks_for_every_survivor(world: int, dead: list[int]) -> None:
    """Survivors diagnose at the same time: one scans, the others read its verdict, and ranks that are
    busy waiting for that verdict are not mistaken for lost ones."""
    pack = dogs(world)
    for r in dead:  # a SIGKILL: the heartbeat stops and nothing marks the rank as ended
        pack[r]._stop.set()
        pack[r]._thread.join()
    survivors = [r for r in range(world) if r not in dead]
    with concurrent.futures.ThreadPoolExecutor(len(survivors)) as pool:
        found = dict(zip(survivors, pool.map(lambda r: pack[r].explain(GLOO_ERROR), survivors)))
    for r in survivors:
        pack[r].stop()
    texts = {str(error) for error, _ in found.values()}
    assert len(texts) == 1 and {count for _, count in found.values()} == {len(dead)}, texts
    text = texts.pop()
    lost = [int(n) for n in re.findall(r"(?:ranks? |, )(\d+) \(host", text)]
    assert lost == dead, text
    assert text.endswith("this rank's collective failed with: Read error [10.0.0.2]:4711: Connection reset by peer")
    assert f"host {HOST}, pid {os.getpid()}" in text


def test_watchdog_finds_nobody_lost_when_all_are_alive() -> None:
    pack = dogs(3)
    pack[2].stop()  # ended on its own: not lost
    assert pack[0].explain(ValueError("a bug on every rank")) is None
    assert pack[1].explain(ValueError("a bug on every rank")) is None  # reads the verdict
    for dog in pack[:2]:
        dog.stop()


def test_watchdog_blames_the_store_host_when_the_store_is_gone() -> None:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    rank0, rank1 = dogs(2, client)
    rank0.stop()
    # Gone at once, before rank 1's first heartbeat (a rank 0 killed in the first second of training): rank 1
    # read rank 0's host and pid when it started, so it can still name them.
    del server  # rank 0, and the store it hosted, are gone
    error, count = rank1.explain(GLOO_ERROR)
    assert count == 1, error
    assert str(error).startswith(
        f"lost rank 0 (host {HOST}, pid {os.getpid()}, store at 127.0.0.1:4711): the "
        "rendezvous store it hosted is unreachable ("
    ), error
    rank1.stop()


def test_watchdog_keeps_the_verdict_when_the_store_host_exits_before_a_slow_survivor_fails() -> None:
    """Rank 3 is still blocked in a collective when rank 0 publishes "lost rank 2" and exits (taking
    the store with it): when rank 3's collective finally fails, it reports rank 2, not rank 0."""
    import torch.distributed as dist

    from ddp_slurm.distributed.watchdog import Watchdog

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pack = [
        Watchdog(
            dist.PrefixStore("test/", dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)),
            r,
            4,
            f"127.0.0.1:{server.port}",
            interval_s=0.2,
            grace_s=1.5,
        ).start()
        for r in range(4)
    ]
    pack[2]._stop.set()  # SIGKILLed
    pack[2]._thread.join()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # ranks 0 and 1 fail at once
        found = list(pool.map(lambda r: pack[r].explain(GLOO_ERROR), (0, 1)))
    deadline = time.monotonic() + 10
    while pack[3]._seen is None and time.monotonic() < deadline:  # rank 3's heartbeat picks the verdict up
        time.sleep(0.05)
    pack[0].linger(lost=1)  # returns as soon as every survivor has seen it
    for dog in pack[:2]:
        dog.stop()
    del server  # rank 0 exits, and the store with it
    error, count = pack[3].explain(RuntimeError("Connection closed by peer [127.0.0.1]:4711"))
    assert count == 1 and str(error).startswith("lost rank 2 (host"), error
    assert str(found[0][0]).split(";")[0] == str(error).split(";")[0]
    pack[3].stop()
