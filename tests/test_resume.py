"""Preemption and exact resume, with real processes, real signals and real files.

Every scenario compares against the same run left alone (computed once per module and world size):
on CPU with one thread per rank, a run stopped by a signal and launched again must end with weights
bit-identical (``torch.equal`` on every tensor) to the uninterrupted one.

Windows are hit without hooks in the product:
- "handler installed" is read from ``/proc/<pid>/status`` (SigCgt), so a signal is never sent
  before the process can take it;
- "inside the evaluation" is made certain by freezing the process (SIGSTOP) right after it logged
  the epoch's last training line, checking that its evaluation line is not written yet, and only
  then queueing the signal and letting it continue (SIGCONT);
- a torchrun worker's rank is read from its environment (``/proc/<pid>/environ``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helpers
import pytest
import tasks_helpers
import torch
from conftest import Launcher, base_env

import ddp_slurm
from ddp_slurm.tools import history, report
from ddp_slurm.train import checkpoint, metrics

RUN_NAME = "r"
STEPS_PER_EPOCH = 5000 // 64
MLP = [
    "model.name=mlp",
    "train.global_batch_size=64",
    "train.epochs=3",
    "train.log_every_steps=2",
    "checkpoint.every_steps=10",
    "checkpoint.keep=100",
    f"run.name={RUN_NAME}",
]
MLP_TOTAL = 3 * STEPS_PER_EPOCH  # 234 steps
# A CNN for the evaluation window: evaluating the 5,000 test images takes it about 0.5 s on one core.
CNN_EPOCH = 5000 // 128
CNN = [
    "model.name=cnn",
    "train.global_batch_size=128",
    "train.epochs=2",
    "train.max_steps=45",
    f"train.log_every_steps={CNN_EPOCH // 3}",
    "checkpoint.every_steps=10",
    "checkpoint.keep=100",
    f"run.name={RUN_NAME}",
]
# eval.every_steps: evaluations at steps 25, 50, 75 of each epoch besides its end (78, 156, 234)
EVAL_MLP = [*MLP, "eval.every_steps=25"]
# The Line task made slow (tasks_helpers.SLOW_LINE_TASK): 8 steps per epoch, an evaluation every 4 steps of
# 100 samples in batches of 10 per rank, each evaluation batch sleeping (a long evaluation).
SLOW_LINE = [*tasks_helpers.SLOW_LINE_RUN, "slow.eval_log=evals.log", "checkpoint.keep=100", f"run.name={RUN_NAME}"]
LONG_EVAL = [*SLOW_LINE, "train.epochs=3", "slow.eval_sleep_s=0.3"]  # 24 steps, 6 evaluations of 1.5-3 s
# Early stopping: the reference run stops at an evaluation near step 80 of 160 (patience 3)
EARLY = [
    *SLOW_LINE,
    "train.epochs=20",
    "slow.train_sleep_s=0.05",
    "slow.eval_sleep_s=0.1",
    "eval.patience=3",
    "eval.min_delta=1e-5",
]
EXIT_STOPPED = 75
TIMEOUT_S = 900.0  # per launch; the machine may be shared and slow, never a timing assertion


# --------------------------------------------------------------------------- processes
def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def catches(pid: int, sig: signal.Signals) -> bool:
    """True once ``pid`` has a handler for ``sig`` (the SigCgt mask in /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)
    return bool(mask and int(mask[1], 16) >> (sig - 1) & 1)


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def state_of(pid: int) -> str:
    """The process state letter (R, S, T, Z, ...) from /proc/<pid>/stat."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@dataclass
class Launch:
    """One launch of training (plain python or torchrun) in the background."""

    proc: subprocess.Popen
    log: Path
    world_size: int
    run_dir: Path
    first_row: int  # rows of metrics.jsonl written before this launch
    _ranks: dict[int, int] = field(default_factory=dict)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def fail(self, why: str) -> None:
        pytest.fail(f"{why}\n--- log of {self.proc.args}\n{self.log_text()[-6000:]}")

    def rows(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return list(metrics.read(path))[self.first_row :] if path.exists() else []

    def wait_for(self, what: str, ready: Callable[[], bool], poll_s: float = 0.005) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            if self.proc.poll() is not None:
                self.fail(f"exited {self.proc.returncode} before {what}")
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what}")
            time.sleep(poll_s)

    def wait_for_row(self, what: str, match: Callable[[dict[str, Any]], bool], poll_s: float = 0.005) -> dict[str, Any]:
        """Wait until this launch wrote a metrics row that ``match``es; return it."""
        found: list[dict[str, Any]] = []

        def ready() -> bool:
            found[:] = [r for r in self.rows() if match(r)]
            return bool(found)

        self.wait_for(what, ready, poll_s)
        return found[0]

    def worker(self, rank: int) -> int:
        """The pid of ``rank``: the process itself, or the torchrun worker with RANK=rank."""
        if self.world_size == 1:
            return self.proc.pid
        if not self._ranks:

            def all_there() -> bool:
                kids = children(self.proc.pid)
                return len(kids) == self.world_size and all("RANK" in environ_of(k) for k in kids)

            self.wait_for(f"{self.world_size} torchrun workers", all_there)
            self._ranks = {int(environ_of(k)["RANK"]): k for k in children(self.proc.pid)}
        return self._ranks[rank]

    def wait_until_catching(self, sig: signal.Signals, ranks: list[int] | None = None) -> None:
        for rank in ranks if ranks is not None else range(self.world_size):
            pid = self.worker(rank)
            self.wait_for(f"rank {rank} to install its {sig.name} handler", lambda: catches(pid, sig))

    def signal(self, rank: int, sig: signal.Signals) -> None:
        os.kill(self.worker(rank), sig)

    def sigterm_during_shutdown(self) -> None:
        """What torchrun's agent does as soon as one worker has exited: SIGTERM to the others. Sent
        here to every rank once it has written its stop and let go of its handlers, i.e. while
        Python shuts down (seconds, with torch loaded): a clean stop must still exit 75."""
        pids = [self.worker(rank) for rank in range(self.world_size)]
        self.wait_for_row("the stop line", lambda r: r["kind"] == "stop")
        deadline = time.monotonic() + TIMEOUT_S
        for pid in pids:
            while catches(pid, signal.SIGTERM) and time.monotonic() < deadline:
                time.sleep(0.002)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:  # already gone: nothing left to interrupt
                pass

    def finish(self) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.fail("did not exit")
        return code, self.log_text()


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    """Collects the launches of a test and kills any still running at the end (a failed test)."""
    started: list[Launch] = []
    yield started
    for launch in started:
        if launch.proc.poll() is None:
            os.killpg(launch.proc.pid, signal.SIGKILL)  # its own session: the agent and its workers
            launch.proc.wait()


def start(
    launches: list[Launch], cwd: Path, world_size: int, overrides: list[str], env: dict[str, str] | None = None
) -> Launch:
    launcher = Launcher(cwd)
    cmd = launcher.cmd_train(*overrides) if world_size == 1 else launcher.cmd_torchrun(world_size, *overrides)
    run_dir = cwd / "runs" / RUN_NAME
    before = len(list(metrics.read(run_dir / "metrics.jsonl"))) if (run_dir / "metrics.jsonl").exists() else 0
    log = cwd / f"launch-{len(launches)}.log"
    launch = Launch(launcher.popen(cmd, env=env or base_env(), log=log), log, world_size, run_dir, before)
    launches.append(launch)
    return launch


def run_to_end(
    launches: list[Launch],
    cwd: Path,
    world_size: int,
    overrides: list[str],
    env: dict[str, str] | None = None,
    trains: bool = True,
) -> Launch:
    """Launch and wait for exit 0; ``trains``: it must also have trained to the end (an ``end`` row)."""
    launch = start(launches, cwd, world_size, overrides, env)
    code, text = launch.finish()
    if code != 0:
        launch.fail(f"exited {code}, expected 0")
    if trains:
        assert launch.rows() and launch.rows()[-1]["kind"] == "end", text
    return launch


def assert_stopped(launch: Launch) -> dict[str, Any]:
    """Every rank exited 75 after a checkpoint of the stop step; returns the ``stop`` row."""
    code, text = launch.finish()
    if launch.world_size == 1:
        if code != EXIT_STOPPED:
            launch.fail(f"exited {code}, expected {EXIT_STOPPED}")
    else:  # torchrun exits 1 and lists each worker's exit code in its summary
        codes = re.findall(r"^\s+exitcode\s*:\s*(-?\d+)", text, re.M)
        if code == 0 or sorted(codes) != [str(EXIT_STOPPED)] * launch.world_size:
            launch.fail(f"torchrun exited {code} with worker exit codes {codes}, expected {EXIT_STOPPED} on every rank")
    stops = [r for r in launch.rows() if r["kind"] == "stop"]
    assert len(stops) == 1, launch.rows()
    assert not [r for r in launch.rows() if r["kind"] == "end"]
    stop = stops[0]
    assert f"stopped on signal at step {stop['step']} with a checkpoint" in text
    state = checkpoint.load_latest(launch.run_dir)
    assert state is not None
    assert (state["step"], state["epoch"], state["finished"]) == (stop["step"], stop["epoch"], False)
    folder = launch.run_dir / "checkpoints"
    assert (folder / f"step-{stop['step']}.pt").exists() or (folder / f"step-{stop['step']}").is_dir()
    assert not [p for p in (launch.run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    return stop


def assert_resumed_from(launch: Launch, step: int) -> None:
    start_row = launch.rows()[0]
    assert start_row["kind"] == "start" and start_row["resumed"] is True and start_row["step"] == step, start_row


def assert_bit_identical(run_dir: Path, reference: dict[str, Any]) -> None:
    state = checkpoint.load_latest(run_dir)
    assert state is not None and state["finished"] and state["step"] == reference["step"]
    assert state["model"].keys() == reference["model"].keys()
    different = [k for k, t in state["model"].items() if not torch.equal(t, reference["model"][k])]
    assert not different, f"weights differ from the uninterrupted run: {different}"
    opt, ref_opt = dict(checkpoint._tensors(state["optimizer"])), dict(checkpoint._tensors(reference["optimizer"]))
    assert opt.keys() == ref_opt.keys() and all(torch.equal(t, ref_opt[k]) for k, t in opt.items())


# --------------------------------------------------------------------------- references
class References:
    """Uninterrupted runs, computed once per module on first use; their run directories are kept."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, Path] = {}

    def run_dir(self, name: str) -> Path:
        if name not in self._done:
            overrides, ws = {
                "mlp-1": (MLP, 1),
                "mlp-2": (MLP, 2),
                "cnn-1": (CNN, 1),
                "mlp-eval-1": (EVAL_MLP, 1),
                "long-eval-1": (LONG_EVAL, 1),
                "long-eval-2": (LONG_EVAL, 2),
                "long-eval-fsdp-2": ([*LONG_EVAL, "dist.strategy=fsdp"], 2),
                "early-2": (EARLY, 2),
            }[name]
            cwd = self.root / name
            cwd.mkdir()
            tasks_helpers.write_slow_line_task(cwd)
            started: list[Launch] = []
            try:
                launch = run_to_end(started, cwd, ws, overrides)
            finally:
                for launch in started:
                    if launch.proc.poll() is None:
                        os.killpg(launch.proc.pid, signal.SIGKILL)
            assert [r["step"] for r in launch.rows() if r["kind"] == "start"] == [0]
            self._done[name] = launch.run_dir
        return self._done[name]

    def final(self, name: str) -> dict[str, Any]:
        state = checkpoint.load_latest(self.run_dir(name))
        assert state is not None and state["finished"]
        return state


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("references"))


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world_size", [1, 2])
def test_signal_to_one_rank_stops_all_and_resume_is_exact(
    references: References, launches: list[Launch], tmp_path: Path, world_size: int
) -> None:
    """SIGUSR2 to the last rank only (with 2 ranks: not rank 0): every rank stops at the same step
    with exit 75 and a checkpoint; launching again finishes bit-identical to the run left alone."""
    reference = references.final(f"mlp-{world_size}")
    first = start(launches, tmp_path, world_size, MLP)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row("training to pass step 10", lambda r: r["kind"] == "train" and r["step"] >= 10)
    first.signal(world_size - 1, signal.SIGUSR2)
    first.sigterm_during_shutdown()
    stop = assert_stopped(first)
    assert stop["requeue"] is True  # the requeue signal, outside Slurm: nothing to requeue, exit 75 all the same
    assert 10 <= stop["step"] < STEPS_PER_EPOCH, f"expected a stop inside the first epoch, got {stop}"
    state = checkpoint.load_latest(first.run_dir)
    assert state["step_in_epoch"] == stop["step"] and state["world_size"] == world_size
    assert not [k for k in state["model"] if k.startswith("module.")]

    second = run_to_end(launches, tmp_path, world_size, MLP)
    assert_resumed_from(second, stop["step"])
    assert_bit_identical(first.run_dir, reference)

    if world_size == 1:  # a finished run launched again says so and exits 0, touching nothing
        again = run_to_end(launches, tmp_path, world_size, MLP, trains=False)
        assert "already finished" in again.log_text() and again.rows() == []
        assert_bit_identical(first.run_dir, reference)


def test_three_interruptions_end_bit_identical(references: References, launches: list[Launch], tmp_path: Path) -> None:
    """Two ranks stopped three times: SIGUSR2 to rank 1 inside the first epoch, SIGUSR2 to rank 1 of
    the relaunch before it takes any step, SIGTERM to rank 0 an epoch later. The fourth launch
    finishes bit-identical to the run left alone."""
    reference = references.final("mlp-2")
    plan = [(1, signal.SIGUSR2, 10), (1, signal.SIGUSR2, None), (0, signal.SIGTERM, STEPS_PER_EPOCH)]
    resumed_at, stops = 0, []
    for rank, sig, after in plan:
        launch = start(launches, tmp_path, 2, MLP)
        launch.wait_until_catching(sig, ranks=[rank])
        if after is not None:
            launch.wait_for_row(
                f"step {resumed_at + after}", lambda r: r["kind"] == "train" and r["step"] >= resumed_at + after
            )
        launch.signal(rank, sig)
        stop = assert_stopped(launch)
        assert stop["requeue"] is (sig == signal.SIGUSR2)
        if stops:
            assert_resumed_from(launch, resumed_at)
        if after is None:  # before the first step: nothing trained, nothing new written
            assert stop["step"] == resumed_at and [r["kind"] for r in launch.rows()] == ["start", "stop"]
        else:
            assert resumed_at + after <= stop["step"] < MLP_TOTAL
        stops.append(stop["step"])
        resumed_at = stop["step"]
    assert stops[0] < STEPS_PER_EPOCH <= stops[2], stops
    last = run_to_end(launches, tmp_path, 2, MLP)
    assert_resumed_from(last, resumed_at)
    assert_bit_identical(last.run_dir, reference)


def test_signal_before_the_first_step(references: References, launches: list[Launch], tmp_path: Path) -> None:
    """SIGUSR2 the moment the process can take it (while it still joins the group, loads the data,
    builds the model): it stops before any training step with a step-0 checkpoint, exit 75, and the
    relaunch is exact."""
    reference = references.final("mlp-1")
    first = start(launches, tmp_path, 1, MLP)
    first.wait_until_catching(signal.SIGUSR2)
    first.signal(0, signal.SIGUSR2)
    stop = assert_stopped(first)
    assert stop["step"] == 0 and [r["kind"] for r in first.rows()] == ["start", "stop"], first.rows()
    assert [s for s, _ in checkpoint.list_checkpoints(first.run_dir)] == [0]

    second = run_to_end(launches, tmp_path, 1, MLP)
    assert_resumed_from(second, 0)
    assert_bit_identical(first.run_dir, reference)


def test_signal_during_evaluation(references: References, launches: list[Launch], tmp_path: Path) -> None:
    """A signal that arrives while the epoch-end evaluation runs: the evaluation is abandoned (no ``eval``
    line), the epoch's last step is the stop checkpoint, still due its evaluation, exit 75; the relaunch
    evaluates it first and is exact (CNN, with BatchNorm buffers)."""
    reference = references.final("cnn-1")
    first = start(launches, tmp_path, 1, CNN)
    first.wait_until_catching(signal.SIGUSR2)
    # The evaluation (about half a second on one core) starts right after this line: react within a millisecond.
    first.wait_for_row(
        "the epoch's last training line", lambda r: r["kind"] == "train" and r["step"] == CNN_EPOCH, poll_s=0.001
    )
    pid = first.worker(0)
    os.kill(pid, signal.SIGSTOP)
    try:
        first.wait_for("the process to freeze", lambda: state_of(pid) == "T")
        evals = [r for r in first.rows() if r["kind"] == "eval"]
        if evals:
            first.fail(f"could not freeze the process inside its evaluation: it already logged {evals}")
        os.kill(pid, signal.SIGUSR2)  # pending until the process continues, inside evaluate()
    finally:
        os.kill(pid, signal.SIGCONT)
    stop = assert_stopped(first)
    assert stop["step"] == CNN_EPOCH and stop["epoch"] == 0  # the epoch ends once its evaluation is done
    kinds = [(r["kind"], r["step"]) for r in first.rows() if r["kind"] != "train"]
    assert kinds == [("start", 0), ("stop", CNN_EPOCH)], kinds
    state = checkpoint.load_latest(first.run_dir)
    assert state["step_in_epoch"] == CNN_EPOCH and state["best"] is None and state["evaluated"] == 0

    second = run_to_end(launches, tmp_path, 1, CNN)
    assert_resumed_from(second, CNN_EPOCH)
    assert [(r["kind"], r["step"]) for r in second.rows() if r["kind"] == "eval"] == [("eval", CNN_EPOCH), ("eval", 45)]
    assert_bit_identical(first.run_dir, reference)


def test_resume_at_another_world_size(references: References, launches: list[Launch], tmp_path: Path) -> None:
    """Stopped with 2 ranks, resumed with 1: same global sample position, same total, weights close."""
    reference = references.final("mlp-2")
    first = start(launches, tmp_path, 2, MLP)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row("training to pass step 10", lambda r: r["kind"] == "train" and r["step"] >= 10)
    first.signal(1, signal.SIGUSR2)
    stop = assert_stopped(first)
    saved = checkpoint.load_latest(first.run_dir)
    assert saved["world_size"] == 2 and saved["step_in_epoch"] == stop["step"] % STEPS_PER_EPOCH

    second = run_to_end(launches, tmp_path, 1, MLP)
    assert_resumed_from(second, stop["step"])
    train_rows = [r for r in second.rows() if r["kind"] == "train"]
    assert train_rows and {r["world_size"] for r in train_rows} == {1}
    assert train_rows[0]["step"] <= stop["step"] + 2  # continued where it stopped, not from the epoch start
    assert [(r["step"], r["epoch"]) for r in second.rows() if r["kind"] == "eval"][-1] == (MLP_TOTAL, 2)
    state = checkpoint.load_latest(first.run_dir)
    assert state["finished"] and state["step"] == MLP_TOTAL and state["world_size"] == 1
    for name, t in state["model"].items():
        # Measured: about 1e-7 apart (summation order); resuming at the wrong sample is about 1e-1 apart.
        torch.testing.assert_close(t, reference["model"][name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


SCONTROL_STUB = """#!/bin/sh
# Stands in for Slurm's scontrol: records how it was called.
echo "$@" >> "{calls}"
"""


def test_sigterm_stops_without_requeue(launches: list[Launch], tmp_path: Path) -> None:
    """Inside a (pretend) Slurm job with requeue on: the requeue signal stops and runs
    `scontrol requeue <job>`; SIGTERM (preemption: Slurm requeues by itself) stops with exit 75 and
    runs nothing."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    stub = bin_dir / "scontrol"
    stub.write_text(SCONTROL_STUB.format(calls=calls))
    stub.chmod(0o755)
    env = base_env(SLURM_JOB_ID="4242", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    first = start(launches, tmp_path, 1, MLP, env)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row("step 10", lambda r: r["kind"] == "train" and r["step"] >= 10)
    first.signal(0, signal.SIGUSR2)
    stop1 = assert_stopped(first)
    assert stop1["requeue"] is True
    assert helpers.requeue_calls(calls) == ["requeue 4242"]  # after the checkpoint was on disk

    second = start(launches, tmp_path, 1, MLP, env)
    second.wait_until_catching(signal.SIGTERM)
    second.wait_for_row("step 20 past the resume", lambda r: r["kind"] == "train" and r["step"] >= stop1["step"] + 20)
    second.signal(0, signal.SIGTERM)
    stop2 = assert_stopped(second)
    assert_resumed_from(second, stop1["step"])
    assert stop2["requeue"] is False and stop2["step"] > stop1["step"]
    assert helpers.requeue_calls(calls) == ["requeue 4242"], "SIGTERM must not requeue"
    assert "requeued Slurm job 4242" in first.log_text() and "requeue" not in second.log_text().lower()


WRITER = """
import sys
import torch
from pathlib import Path
from ddp_slurm.train import checkpoint
run_dir = Path(sys.argv[1])
state = checkpoint.load_latest(run_dir)
for i in range(1000):
    # the real training state plus ballast, so that each write takes a while
    checkpoint.save(run_dir, dict(state, ballast=torch.full((32 * 2**20,), float(i))), keep=3)
    print("saved", i, flush=True)
"""


def test_writer_killed_mid_save_leaves_previous_checkpoint(
    references: References, launches: list[Launch], tmp_path: Path
) -> None:
    """SIGKILL while a checkpoint is being written: the previous file under that name stays loadable,
    a truncated newer checkpoint is skipped with a warning, and the next launch resumes from the
    intact one, removes the writer's leftover and finishes bit-identical."""
    reference_dir = references.run_dir("mlp-1")
    run_dir = tmp_path / "runs" / RUN_NAME
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(reference_dir / "config.yaml", run_dir / "config.yaml")
    shutil.copy(reference_dir / "checkpoints" / "step-100.pt", run_dir / "checkpoints" / "step-100.pt")

    log = tmp_path / "writer.log"
    with open(log, "w") as out:
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(run_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=base_env(),
            start_new_session=True,
        )
    try:
        temps = lambda: list((run_dir / "checkpoints").glob(".step-100.pt.tmp-*"))  # noqa: E731
        deadline = time.monotonic() + TIMEOUT_S
        while not ("saved 0" in log.read_text() and temps()):  # the second save is being written
            assert writer.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "writer never started its second save"
            time.sleep(0.001)
        writer.kill()
        writer.wait()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert temps(), "the writer finished its save before it was killed: nothing was tested"
    completed = len(re.findall(r"^saved \d+$", log.read_text(), re.M))
    state = checkpoint.load_latest(run_dir)
    # The last complete save (or the one just after it, when the kill fell between the rename and the print).
    assert state["step"] == 100 and state["ballast"][0].item() in (completed - 1, completed)

    # A newer checkpoint cut short (a copy of the real one, half its bytes).
    newer = run_dir / "checkpoints" / "step-110.pt"
    data = (reference_dir / "checkpoints" / "step-110.pt").read_bytes()
    newer.write_bytes(data[: len(data) // 2])

    resumed = run_to_end(launches, tmp_path, 1, MLP)
    text = resumed.log_text()
    assert re.search(r"WARNING .*skipping checkpoint \S*step-110\.pt", text), text
    assert_resumed_from(resumed, 100)
    assert not temps(), "the killed writer's temporary file was not removed"
    assert_bit_identical(run_dir, references.final("mlp-1"))


def test_resume_command_reuses_the_run_config_and_refuses_what_a_resume_cannot_take(launcher) -> None:
    """``ddp-slurm resume RUN_DIR``: the run's own config.yaml with only the overrides given; a change that
    would make it compute something else is the training's one-line refusal, which names the command."""
    fast = ["model.name=mlp", "train.max_steps=2", "train.lr=1e-3", "run.name=mine"]
    launcher.run(launcher.cmd_train(*fast), check=True)
    ddp_slurm = [sys.executable, "-m", "ddp_slurm"]
    again = launcher.run([*ddp_slurm, "resume", "runs/mine", "train.log_every_steps=1"])
    assert again.returncode == 0 and "already finished at step 2" in again.stderr, again.stderr
    other = launcher.run([*ddp_slurm, "resume", "runs/mine", "train.lr=0.5"])
    assert other.returncode == 2, other.stderr
    [line] = [x for x in other.stderr.splitlines() if "error" in x.lower() or "another config" in x]
    assert "train.lr: 0.001 -> 0.5" in line and "`ddp-slurm resume runs/mine`" in line
    assert "`--config runs/mine/config.yaml`" in line
    plain = launcher.run(launcher.cmd_train("run.name=mine"))  # the defaults are another config: same refusal
    assert plain.returncode == 2 and "ddp-slurm resume runs/mine" in plain.stderr
    missing = launcher.run([sys.executable, "-m", "ddp_slurm.resume", "runs/nothing"])
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "runs/nothing is not a run directory (no config.yaml in it)" in missing.stderr
    bare = launcher.run([*ddp_slurm, "resume"])
    assert bare.returncode == 2 and bare.stderr.count("\n") == 1 and "RUN_DIR" in bare.stderr, bare.stderr


# --------------------------------------------------------------------------- evaluations (issue 31)
def _evals(run_dir: Path, *fields: str) -> list[tuple[Any, ...]]:
    return [
        tuple(r[f] for f in ("step", *fields)) for r in metrics.read(run_dir / "metrics.jsonl") if r["kind"] == "eval"
    ]


def _assert_same_end_state(run_dir: Path, reference_dir: Path) -> None:
    """Model, optimizer, position and every rank's RNG streams of the final checkpoints are the same."""
    reference = checkpoint.load_latest(reference_dir)
    assert_bit_identical(run_dir, reference)
    state = checkpoint.load_latest(run_dir)
    where = ("step", "epoch", "step_in_epoch", "best", "best_step", "stale", "evaluated")
    assert {k: state[k] for k in where} == {k: reference[k] for k in where}
    assert len(state["rng"]) == len(reference["rng"])
    for ours, theirs in zip(state["rng"], reference["rng"]):
        assert ours["python"] == theirs["python"] and torch.equal(ours["torch"], theirs["torch"])


def _eval_lines(cwd: Path) -> list[tuple[float, str]]:
    """(time, rank) of every evaluation batch the slow task began, in order."""
    path = cwd / "evals.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(float(t), rank) for t, rank, _ in (line.split() for line in lines)]


def test_evaluation_every_steps_and_a_mid_epoch_resume_stay_exact(
    references: References, launches: list[Launch], tmp_path: Path
) -> None:
    """``eval.every_steps=25``: evaluations mid-epoch and at each epoch's end, every test sample counted;
    stopped mid-epoch after a mid-epoch evaluation and resumed, the run ends with the same model,
    optimizer, position and RNG streams, and the same evaluation lines, as the run left alone."""
    reference_dir = references.run_dir("mlp-eval-1")
    expected = sorted({*range(25, MLP_TOTAL + 1, 25), *range(STEPS_PER_EPOCH, MLP_TOTAL + 1, STEPS_PER_EPOCH)})
    assert [s for s, _ in _evals(reference_dir, "test_samples")] == expected
    assert {n for _, n in _evals(reference_dir, "test_samples")} == {5000}

    first = start(launches, tmp_path, 1, EVAL_MLP)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row("the evaluation at step 25", lambda r: r["kind"] == "eval" and r["step"] == 25)
    first.wait_for_row("training past step 30", lambda r: r["kind"] == "train" and r["step"] >= 30)
    first.signal(0, signal.SIGUSR2)
    stop = assert_stopped(first)
    assert 30 <= stop["step"] < STEPS_PER_EPOCH, stop

    second = run_to_end(launches, tmp_path, 1, EVAL_MLP)
    assert_resumed_from(second, stop["step"])
    _assert_same_end_state(first.run_dir, reference_dir)
    assert _evals(first.run_dir, "accuracy", "loss") == _evals(reference_dir, "accuracy", "loss")


@pytest.mark.parametrize("world_size, during, strategy", [(1, 8, "ddp"), (2, 12, "ddp"), (2, 12, "fsdp")])
def test_a_stop_inside_a_long_evaluation_abandons_it_and_the_resume_redoes_it(
    references: References, launches: list[Launch], tmp_path: Path, world_size: int, during: int, strategy: str
) -> None:
    """USR2 while an evaluation runs (each of its batches sleeps 0.3 s): the evaluation is abandoned at the
    next batch on every rank, no ``eval`` line is written for it, the step is checkpointed and every rank
    exits 75. The relaunch evaluates that step first; its evaluation lines and final weights equal the run
    left alone. With 1 rank the evaluation at an epoch's end (step 8), with 2 ranks one mid-epoch (step 12),
    under ddp and under fsdp (whose ranks run padded batches: every forward is a collective)."""
    reference_dir = references.run_dir(f"long-eval-{world_size}" if strategy == "ddp" else "long-eval-fsdp-2")
    overrides = [*LONG_EVAL, f"dist.strategy={strategy}"]
    tasks_helpers.write_slow_line_task(tmp_path)
    per_eval = 10  # batches of 10 over 100 samples, all ranks together
    first = start(launches, tmp_path, world_size, overrides)
    first.wait_until_catching(signal.SIGUSR2)
    before = (during // 4 - 1) * per_eval  # the batches of the evaluations before the one to interrupt
    first.wait_for("the evaluation to be under way", lambda: len(_eval_lines(tmp_path)) >= before + world_size + 1)
    sent = time.time()
    first.signal(world_size - 1, signal.SIGUSR2)
    stop = assert_stopped(first)
    late = [line for line in _eval_lines(tmp_path) if line[0] > sent]
    assert len(late) <= world_size, f"evaluation batches begun after the signal: {late}"
    assert stop["step"] == during and during not in [s for (s,) in _evals(first.run_dir)], first.rows()
    assert "evaluation abandoned on a stop signal" in first.log_text()
    assert checkpoint.load_latest(first.run_dir)["evaluated"] < during

    second = run_to_end(launches, tmp_path, world_size, overrides)
    assert_resumed_from(second, during)
    assert second.rows()[1]["kind"] == "eval" and second.rows()[1]["step"] == during, second.rows()[:3]
    assert _evals(first.run_dir, "mse", "test_samples") == _evals(reference_dir, "mse", "test_samples")
    _assert_same_end_state(first.run_dir, reference_dir)


def test_early_stopping_survives_three_interruptions(
    references: References, launches: list[Launch], tmp_path: Path
) -> None:
    """``eval.patience=3``: two ranks stopped three times at different moments (USR2 in training, USR2 to
    rank 1 as soon as the relaunch evaluates, SIGTERM to rank 0 later) stop early at the same evaluation,
    with the same best value and weights, as the run left alone; the early stop ends the job 0 with an
    ``early_stop`` line, and launching again does nothing."""
    reference_dir = references.run_dir("early-2")
    ref_rows = list(metrics.read(reference_dir / "metrics.jsonl"))
    ref_stop = [r for r in ref_rows if r["kind"] == "early_stop"]
    assert len(ref_stop) == 1 and ref_rows[-1]["kind"] == "end" and ref_rows[-1]["step"] == ref_stop[0]["step"]
    assert ref_stop[0]["step"] >= 40, ref_stop  # late enough for three interruptions before it

    tasks_helpers.write_slow_line_task(tmp_path)
    resumed_at, stops = 0, []
    for rank, sig, moment in [(1, signal.SIGUSR2, "train"), (1, signal.SIGUSR2, "eval"), (0, signal.SIGTERM, "train")]:
        launch = start(launches, tmp_path, 2, EARLY)
        launch.wait_until_catching(sig, ranks=[rank])
        if moment == "train":
            launch.wait_for_row(
                "six more steps", lambda r: r["kind"] == "train" and r["step"] >= resumed_at + 6, poll_s=0.01
            )
        else:
            seen = len(_eval_lines(tmp_path))
            launch.wait_for("an evaluation under way", lambda: len(_eval_lines(tmp_path)) >= seen + 2, poll_s=0.001)
        launch.signal(rank, sig)
        stop = assert_stopped(launch)
        if stops:
            assert_resumed_from(launch, resumed_at)
        if moment == "eval":
            assert "evaluation abandoned on a stop signal" in launch.log_text(), launch.log_text()[-3000:]
        stops.append(stop["step"])
        resumed_at = stop["step"]
    assert stops == sorted(stops) and stops[-1] < ref_stop[0]["step"], (stops, ref_stop)

    last = run_to_end(launches, tmp_path, 2, EARLY)
    early = [r for r in last.rows() if r["kind"] == "early_stop"]
    assert len(early) == 1 and last.rows()[-1]["kind"] == "end"
    assert {k: early[0][k] for k in ("step", "best", "best_step")} == {
        k: ref_stop[0][k] for k in ("step", "best", "best_step")
    }
    assert "early stop at step" in last.log_text()
    _assert_same_end_state(last.run_dir, reference_dir)
    again = run_to_end(launches, tmp_path, 2, EARLY, trains=False)
    assert "already finished" in again.log_text() and again.rows() == []


@pytest.mark.parametrize("strategy, world_size", [("ddp", 1), ("fsdp", 2)])
def test_the_best_checkpoint_survives_keep_1(
    references: References, launches: list[Launch], tmp_path: Path, strategy: str, world_size: int
) -> None:
    """``checkpoint.keep=1``: the run ends with its last checkpoint and, beside it, the one at the best
    value of the task's metric, named in the run directory's ``best``; ``run.init_from=<run dir>/best``
    starts a new run from it (read through the gate like any checkpoint)."""
    tasks_helpers.write_slow_line_task(tmp_path)
    fast = [*EARLY, "slow.train_sleep_s=0", "slow.eval_sleep_s=0", "slow.eval_log=null", "checkpoint.keep=1"]
    launch = run_to_end(launches, tmp_path, world_size, [*fast, f"dist.strategy={strategy}"])
    rows = launch.rows()
    early, end = [r for r in rows if r["kind"] == "early_stop"], rows[-1]
    best_step = early[0]["best_step"]
    assert best_step < end["step"], "the best must be older than the last checkpoint for this test"
    assert min(r["mse"] for r in rows if r["kind"] == "eval") == early[0]["best"]
    suffix = ".pt" if strategy == "ddp" else ""
    names = sorted(p.name for p in (launch.run_dir / "checkpoints").iterdir())
    assert names == sorted({f"step-{best_step}{suffix}", f"step-{end['step']}{suffix}"}), names
    assert (launch.run_dir / "best").read_text() == f"step-{best_step}{suffix}\n"
    shown = report.summary(history.read_history(launch.run_dir))
    assert f"stopped early at step {end['step']} (no improvement of mse" in shown, shown
    assert f"(step {best_step}; lower is better)" in shown, shown

    run_to_end(  # a warm start from the best: the same checkpoint, whichever strategy wrote it, read by ddp
        launches,
        tmp_path,
        1,
        [*fast, "run.name=warm", f"run.init_from={launch.run_dir / 'best'}", "train.epochs=1"],
        trains=False,
    )
    start_row = next(r for r in metrics.read(tmp_path / "runs" / "warm" / "metrics.jsonl") if r["kind"] == "start")
    assert start_row["init_step"] == best_step, start_row

    # Exported for inference (gathered from the shards under fsdp), loaded back into the task's model and
    # evaluated by hand: the run's best value.
    out = tmp_path / "exported"
    res = export(tmp_path, launch.run_dir, "--best", out)
    assert res.returncode == 0 and f"(step {best_step}; mse=" in res.stdout, res.stderr
    about = json.loads((out / "export.json").read_text())
    assert (about["step"], about["strategy"], about["evaluation"]["mse"]) == (best_step, strategy, early[0]["best"])
    model, task = ddp_slurm.load_model(out, with_task=True)
    x, y = task.eval_data().tensors
    with torch.no_grad():
        assert task.eval_step(model, (x, y))["mse"].item() / len(x) == pytest.approx(early[0]["best"], rel=1e-5)
    again = export(tmp_path, launch.run_dir, "--best", out)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "exists" in again.stderr


def export(cwd: Path, *args: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_slurm.export", *map(str, args)],
        cwd=cwd,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _started(run_dir: Path, *starts: dict[str, Any]) -> Path:
    run_dir.mkdir(parents=True)
    lines = [{"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0, "job_id": None, **s} for s in starts]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines))
    return run_dir


def test_resume_keeps_the_world_size_of_the_run_s_last_launch_unless_told(tmp_path: Path) -> None:
    """``ddp-slurm resume`` as a plain process: the last launch's world size, not 1 (a 2-rank run brought back at
    1 rank loses bit-identity); ``--nproc-per-node`` chooses; a run of a Slurm job or a forged size is one line."""
    from ddp_slurm import resume

    two = _started(tmp_path / "two", {"world_size": 1}, {"world_size": 2, "step": 40})
    assert resume.world_size(two, None) == 2 and resume.world_size(two, 1) == 1
    assert resume.launcher_argv(two, 2, ["log.csv=true"])[2:] == [
        "ddp_slurm.launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "ddp_slurm.resume",
        str(two),
        "log.csv=true",
    ]
    assert resume.world_size(tmp_path / "never", None) == 1  # no metrics: nothing trained yet
    slurm = _started(tmp_path / "slurm", {"world_size": 16, "job_id": "123"})
    with pytest.raises(ValueError, match=r"world size 16 in a Slurm job: resubmit it .* --nproc-per-node N"):
        resume.world_size(slurm, None)
    assert resume.world_size(slurm, 4) == 4
    forged = _started(tmp_path / "forged", {"world_size": 10**6})
    with pytest.raises(ValueError, match="says world size 1000000; pass --nproc-per-node N"):
        resume.world_size(forged, None)


def test_resume_under_a_launcher_is_one_rank_and_never_relaunches() -> None:
    from ddp_slurm import resume

    assert not resume.one_rank_of_a_launch({})
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    torchrun |= {"MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    assert resume.one_rank_of_a_launch(torchrun)


def test_resume_s_rank_count_flag_is_checked_in_one_line(launcher) -> None:
    res = launcher.run([sys.executable, "-m", "ddp_slurm.resume", "--nproc-per-node", "0", "runs/x"])
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "from 1 to 1024, got '0'" in res.stderr, res.stderr
    launcher.run(launcher.cmd_train("model.name=mlp", "train.max_steps=1", "run.name=one"), check=True)
    env = base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="localhost")
    env["MASTER_PORT"] = "29500"
    ranked = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.resume", "--nproc-per-node", "2", "runs/one"],
        cwd=launcher.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ranked.returncode == 2 and ranked.stderr.count("\n") == 1, ranked.stderr
    assert "already one rank of a launch" in ranked.stderr  # never silently ignored


def test_resume_of_a_finished_run_launches_nothing(tmp_path: Path) -> None:
    """``ddp-slurm resume`` of a run that finished once started its ranks and a rendezvous only to say so: it
    now reads the newest checkpoint first and says so itself (no launch, no new ``start`` line)."""
    tasks_helpers.write_line_task(tmp_path)
    launcher = Launcher(tmp_path)
    made = launcher.run(
        launcher.cmd_torchrun(
            2, "task=line_task.py:Line", *tasks_helpers.LINE_RUN, "train.max_steps=4", "run.name=done"
        ),
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    starts = [r for r in metrics.read(tmp_path / "runs/done/metrics.jsonl") if r["kind"] == "start"]
    again = launcher.run([sys.executable, "-m", "ddp_slurm", "resume", "runs/done"], timeout=300)
    assert again.returncode == 0 and "already finished at step 4; nothing to do" in again.stderr, again.stderr
    assert "local ranks" not in again.stderr  # the launcher was never started
    assert [r for r in metrics.read(tmp_path / "runs/done/metrics.jsonl") if r["kind"] == "start"] == starts
