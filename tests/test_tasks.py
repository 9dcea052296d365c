"""Tasks the package does not know: selected by path, run by every local entry point, resumed exactly.

- A third, minimal task (``Line``, its source in tests/tasks_helpers.py, written to a file per
  test) through plain python, torchrun (2 ranks) and ``ddp_slurm.run``.
- Bad task paths: exit 2, one line, nothing created.
- The addition example (examples/addition: dropout, an operand-swap augmentation drawn inside
  ``dataset[i]``, the Dataset path with 2 workers per rank): a SIGUSR2 mid-epoch, then a relaunch,
  ends bit-identical to the same run left alone at world size 1 and 2; stopped at 2 ranks and
  resumed at 1 it finishes, with the documented semantics.

Real processes, real signals, real files (the helpers of test_resume.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_resume
import torch
from conftest import Launcher, base_env
from tasks_helpers import LINE_RUN, addition_tiny, write_line_task
from test_resume import RUN_NAME, Launch, assert_bit_identical, assert_resumed_from, assert_stopped, run_to_end, start

from ddp_slurm.train import checkpoint

launches = test_resume.launches  # the fixture that kills a failed test's launches

ADD_STEPS_PER_EPOCH = 2048 // 64
ADD = [*addition_tiny(epochs=2), f"run.name={RUN_NAME}"]
ADD_TOTAL = 2 * ADD_STEPS_PER_EPOCH


# --------------------------------------------------------------------------- bad task paths
BAD_TASKS = {
    "no module": (["task=no_such_package.tasks:Digits"], "cannot import 'no_such_package.tasks'"),
    "no file": (["task=nowhere/task.py:Digits"], "file nowhere/task.py not found"),
    "no class": (["task=line_task.py:Circle"], "has no 'Circle'"),
    "not a task": (["task=line_task.py:NotATask"], "is not a ddp_slurm.Task subclass"),
    "missing method": (["task=line_task.py:Incomplete"], "Incomplete does not define training_step()"),
    "not an import path": (["task=line_task"], "is not an import path"),
    "unknown key": (["task=line_task.py:Line", "line.sise=10"], "did you mean 'line.size'?"),
    "wrong type": (["task=line_task.py:Line", "line.size=many"], "line.size in the command line: expected an integer"),
    "value check": (["task=line_task.py:Line", "line.noise=-1"], "expected a number >= 0"),
    "runtime key of another task": (["task=line_task.py:Line", "model.name=mlp"], "unknown config section 'model'"),
    "task's own check": (["task=line_task.py:Line", "train.global_batch_size=512"], "> line.size=256"),
}


@pytest.mark.parametrize("case", BAD_TASKS, ids=list(BAD_TASKS))
def test_bad_task_exits_2_with_one_line_and_creates_nothing(tmp_path: Path, case: str) -> None:
    write_line_task(tmp_path)
    overrides, expected = BAD_TASKS[case]
    res = Launcher(tmp_path).run(Launcher(tmp_path).cmd_train(*overrides, "run.name=bad"), timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stdout + res.stderr
    assert len(lines) == 1 and lines[0].startswith("ddp_slurm.train: error: "), lines
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()


def test_bad_task_through_the_python_api_returns_2(tmp_path: Path) -> None:
    write_line_task(tmp_path)
    code = "import ddp_slurm, sys; sys.exit(ddp_slurm.run('line_task.py:NotATask', ['run.name=bad']))"
    res = Launcher(tmp_path).run([sys.executable, "-c", code], timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().count("\n") == 0 and "is not a ddp_slurm.Task subclass" in res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("task", ["nowhere.py:Digits", "line_task.py:NotATask", "line_task.py:Incomplete"])
def test_bad_task_through_submit_exits_2_before_submitting(tmp_path: Path, task: str) -> None:
    """``python -m ddp_slurm.submit`` checks the task on the submitting machine before anything is queued:
    nothing reaches Slurm (a dry run imports no task: tests/test_planted_task.py)."""
    write_line_task(tmp_path)
    cmd = [sys.executable, "-m", "ddp_slurm.submit", "--nodes", "4", f"task={task}"]
    res = Launcher(tmp_path).run(cmd, timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert lines[0].startswith("python -m ddp_slurm.submit: error: task=") and not (tmp_path / "runs").exists()


# A task file that runs something at import: a script without a `__main__` guard, or one that fails. Training
# must not exit 0 (Slurm would record COMPLETED with nothing trained) nor print a traceback.
IMPORT_TIME = {
    "sys.exit(0)": ("import sys\nsys.exit(0)\n", "importing script_task.py called sys.exit(0)"),
    "sys.exit(message)": ("raise SystemExit('usage: x')\n", "called sys.exit('usage: x')"),
    "an exception": ("x = {}['missing']\n", "importing script_task.py raised KeyError: 'missing'"),
    "in a package": (None, "importing 'pkg_task.tasks' ("),
}


@pytest.mark.parametrize("case", IMPORT_TIME, ids=list(IMPORT_TIME))
def test_task_that_exits_or_raises_at_import_exits_2_naming_the_file(tmp_path: Path, case: str) -> None:
    source, expected = IMPORT_TIME[case]
    if source is None:  # a module found by import path: its file is named
        (tmp_path / "pkg_task").mkdir()
        (tmp_path / "pkg_task" / "tasks.py").write_text("import sys\nsys.exit(0)\n")
        spec = "pkg_task.tasks:Line"
    else:
        (tmp_path / "script_task.py").write_text(source)
        spec = "script_task.py:Line"
    res = Launcher(tmp_path).run(Launcher(tmp_path).cmd_train(f"task={spec}", "run.name=bad"), timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stdout + res.stderr
    assert len(lines) == 1 and lines[0].startswith("ddp_slurm.train: error: task="), lines
    assert expected in lines[0], lines[0]
    if source is None:
        assert str(tmp_path / "pkg_task" / "tasks.py") in lines[0], lines[0]
    assert res.stdout == "" and not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- the minimal task, every entry point
def assert_line_learned(run_dir: Path, world_size: int) -> dict[str, Any]:
    state = checkpoint.load_latest(run_dir)
    assert state is not None and state["finished"] and state["step"] == 24
    assert state["world_size"] == world_size and len(state["rng"]) == world_size  # every rank's RNG streams
    weight, bias = state["model"]["weight"].item(), state["model"]["bias"].item()
    assert abs(weight - 3) < 0.3 and abs(bias - 1) < 0.3, (weight, bias)
    assert state["best"] is not None and state["best"] < 0.1  # best_metric "mse", lower is better
    assert state["config"]["task"].endswith(":Line")
    return state


@pytest.mark.parametrize("world_size, task", [(1, "line_task.py:Line"), (2, "my_project.tasks:Line")])
def test_minimal_task_trains_through_python_and_torchrun(
    launches: list[Launch], tmp_path: Path, world_size: int, task: str
) -> None:
    """By file (one process) and by import path from the working directory (torchrun, 2 ranks)."""
    write_line_task(tmp_path)
    (tmp_path / "my_project").mkdir()
    (tmp_path / "my_project" / "tasks.py").write_text((tmp_path / "line_task.py").read_text())
    launch = run_to_end(launches, tmp_path, world_size, [f"task={task}", *LINE_RUN, f"run.name={RUN_NAME}"])
    recorded = f"{tmp_path / task}" if task.endswith(".py:Line") else task  # a file by its absolute path
    assert f"task: {recorded}\n" in (launch.run_dir / "config.yaml").read_text()
    evals = [r for r in launch.rows() if r["kind"] == "eval"]
    assert len(evals) == 3 and evals[-1]["test_samples"] == 100 and evals[-1]["mse"] < 0.1, evals
    assert launch.rows()[-1]["best_mse"] == min(r["mse"] for r in evals)
    assert_line_learned(launch.run_dir, world_size)


def test_a_relative_task_file_is_recorded_absolute_and_resumes_from_anywhere(tmp_path: Path) -> None:
    """``task=line_task.py:Line`` typed in the project folder: config.yaml names the file by its absolute path,
    so ``ddp-slurm resume`` finds it from another working directory (it was "file not found", exit 2)."""
    project = tmp_path / "project"
    project.mkdir()
    write_line_task(project)
    made = Launcher(project).run(
        Launcher(project).cmd_train("task=line_task.py:Line", *LINE_RUN, "train.max_steps=4", "run.name=rel"),
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    assert f"task: {project / 'line_task.py'}:Line\n" in (project / "runs/rel/config.yaml").read_text()
    again = Launcher(tmp_path).run([sys.executable, "-m", "ddp_slurm", "resume", "project/runs/rel"], timeout=300)
    assert again.returncode == 0 and "already finished at step 4" in again.stderr, again.stderr
    same = Launcher(project).run(  # the same relative path typed again in the project folder: the same run
        Launcher(project).cmd_train("task=line_task.py:Line", *LINE_RUN, "train.max_steps=4", "run.name=rel"),
        timeout=300,
    )
    assert same.returncode == 0 and "already finished at step 4" in same.stderr, same.stderr


API = """
import sys
import ddp_slurm
from line_task import Line

code = ddp_slurm.run(Line, sys.argv[1:])
print("returned", code)
again = ddp_slurm.run("line_task.py:Line", ["run.name=by-path", *sys.argv[2:]])
print("returned", again)
"""


def test_minimal_task_through_the_python_api(tmp_path: Path) -> None:
    """``ddp_slurm.run(cls, overrides)`` and ``ddp_slurm.run("file.py:Name", ...)`` in one process:
    each trains and returns 0 (it never exits the process)."""
    write_line_task(tmp_path)
    (tmp_path / "api.py").write_text(API)
    res = Launcher(tmp_path).run([sys.executable, "api.py", "run.name=by-class", *LINE_RUN], timeout=600)
    assert res.returncode == 0 and res.stdout.splitlines()[-2:] == ["returned 0", "returned 0"], res.stdout + res.stderr
    for name in ("by-class", "by-path"):
        assert_line_learned(tmp_path / "runs" / name, 1)


# --------------------------------------------------------------------------- the example: exact resume
class References:
    """Uninterrupted runs of the addition example, once per module and world size."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[int, Path] = {}

    def final(self, world_size: int) -> dict[str, Any]:
        if world_size not in self.done:
            cwd = self.root / f"ws{world_size}"
            cwd.mkdir()
            started: list[Launch] = []
            try:
                launch = run_to_end(started, cwd, world_size, ADD)
            finally:
                for launch in started:
                    if launch.proc.poll() is None:
                        launch.proc.kill()
            assert [r["step"] for r in launch.rows() if r["kind"] == "start"] == [0]
            self.done[world_size] = launch.run_dir
        state = checkpoint.load_latest(self.done[world_size])
        assert state is not None and state["finished"] and state["step"] == ADD_TOTAL
        return state


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("addition-references"))


def stop_mid_epoch(launches: list[Launch], cwd: Path, world_size: int, after_step: int = 6) -> dict[str, Any]:
    """Launch the example, SIGUSR2 to the last rank once it has trained ``after_step`` steps; every rank
    stops with exit 75 and a checkpoint inside the first epoch. Returns the stop row."""
    first = start(launches, cwd, world_size, ADD)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row(f"step {after_step}", lambda r: r["kind"] == "train" and r["step"] >= after_step)
    first.signal(world_size - 1, signal.SIGUSR2)
    stop = assert_stopped(first)
    assert stop["requeue"] is True
    assert after_step <= stop["step"] < ADD_STEPS_PER_EPOCH, f"expected a stop inside the first epoch, got {stop}"
    saved = checkpoint.load_latest(first.run_dir)
    assert saved["step_in_epoch"] == stop["step"] and saved["world_size"] == world_size
    assert len(saved["rng"]) == world_size
    return stop


@pytest.mark.parametrize("world_size", [1, 2])
def test_example_stopped_mid_epoch_resumes_bit_identical(
    references: References, launches: list[Launch], tmp_path: Path, world_size: int
) -> None:
    """Dropout on, augmentation inside ``dataset[i]``, 2 DataLoader workers per rank: stopped by
    SIGUSR2 mid-epoch and launched again, the run ends with the weights and optimizer state of the
    run left alone (torch.equal on every tensor)."""
    reference = references.final(world_size)
    stop = stop_mid_epoch(launches, tmp_path, world_size)
    second = run_to_end(launches, tmp_path, world_size, ADD)
    assert_resumed_from(second, stop["step"])
    evals = [r for r in second.rows() if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [ADD_STEPS_PER_EPOCH, ADD_TOTAL] and evals[-1]["test_samples"] == 256
    assert_bit_identical(second.run_dir, reference)


def test_example_resumes_at_another_world_size(references: References, launches: list[Launch], tmp_path: Path) -> None:
    """Stopped with 2 ranks, resumed with 1: it continues at the stop step with the same global
    batches (same samples, same order) and fresh per-rank RNG streams, and finishes; the weights are
    close to the uninterrupted 2-rank run's, not equal (other dropout masks)."""
    reference = references.final(2)
    stop = stop_mid_epoch(launches, tmp_path, 2)
    second = run_to_end(launches, tmp_path, 1, ADD)
    assert_resumed_from(second, stop["step"])
    assert "fresh per-rank RNG streams" in second.log_text()
    train_rows = [r for r in second.rows() if r["kind"] == "train"]
    assert train_rows and {r["world_size"] for r in train_rows} == {1}
    assert train_rows[0]["step"] <= stop["step"] + 2  # where it stopped, not at the epoch's start
    state = checkpoint.load_latest(second.run_dir)
    assert state["finished"] and state["step"] == ADD_TOTAL and state["world_size"] == 1 and len(state["rng"]) == 1
    drift = max((t - reference["model"][k]).abs().max().item() for k, t in state["model"].items())
    assert 0 < drift < 0.5, drift


# --------------------------------------------------------------------------- a task with state of its own
COUNTING = """
from line_task import Line


class Counting(Line):
    \"\"\"Line that counts its training steps (as a curriculum or an EMA would), checkpointed as its own state.\"\"\"

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.calls = 0

    def training_step(self, model, batch):
        self.calls += 1
        return super().training_step(model, batch)

    def state_dict(self):
        return {**super().state_dict(), "calls": self.calls}

    def load_state_dict(self, state):
        super().load_state_dict({k: v for k, v in state.items() if k != "calls"})
        self.calls = state["calls"]
"""


def test_task_state_is_exact_across_an_interrupt_at_two_ranks(launches: list[Launch], tmp_path: Path) -> None:
    """training_step runs once per real step and never for DDP's warm-up: a task that counts its steps ends
    a run stopped and resumed (2 ranks) with the count of one left alone, the number of steps."""
    write_line_task(tmp_path)
    (tmp_path / "counting.py").write_text(COUNTING)
    run = ["task=counting.py:Counting", *LINE_RUN, f"run.name={RUN_NAME}"]
    first = start(launches, tmp_path, 2, run)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row("step 8", lambda r: r["kind"] == "train" and r["step"] >= 8)
    first.signal(1, signal.SIGUSR2)
    stop = assert_stopped(first)
    assert stop["step"] < 24
    assert checkpoint.load_latest(first.run_dir)["task"]["calls"] == stop["step"]
    second = run_to_end(launches, tmp_path, 2, run)
    assert_resumed_from(second, stop["step"])
    state = checkpoint.load_latest(second.run_dir)
    assert state["finished"] and state["step"] == 24 and state["task"]["calls"] == 24, state["task"]


# --------------------------------------------------------------------------- the example's data
def values(digits: torch.Tensor) -> torch.Tensor:
    """Rows of decimal digits (most significant first) -> the numbers."""
    return (digits * torch.tensor([10**i for i in range(digits.shape[1] - 1, -1, -1)])).sum(1)


def test_example_data_is_generated_once_deterministic_and_atomic(tmp_path: Path) -> None:
    """``prepare_data`` writes the token file once (rank 0), the same bytes from the same seed, and
    leaves no temporary file; a second run reuses it."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from task import generate; from pathlib import Path; "
        "generate(Path(sys.argv[2]), 3, 500, 50, 7)"
    )
    folder = str(Path(__file__).resolve().parents[1] / "examples" / "addition")
    for name in ("a.u8", "b.u8"):
        subprocess.run([sys.executable, "-c", code, folder, str(tmp_path / name)], check=True, env=base_env())
    a, b = (tmp_path / "a.u8").read_bytes(), (tmp_path / "b.u8").read_bytes()
    assert a == b and len(a) == 550 * 10
    rows = torch.tensor(list(a)).view(550, 10)
    assert torch.equal(values(rows[:, :3]) + values(rows[:, 3:6]), values(rows[:, 6:]))
    pairs = {tuple(r) for r in rows[:, :6].tolist()}
    assert len(pairs) == 550  # distinct pairs: the held-out ones are never trained on
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.u8", "b.u8"]


def test_percent_metrics_must_be_a_tuple_of_names() -> None:
    """A task's ``percent_metrics`` is checked when the task is chosen (exit 2, one line), not at the first log."""
    from ddp_slurm import taskref
    from ddp_slurm.tasks.mnist import MNIST

    class Wrong(MNIST):
        percent_metrics = "accuracy"  # a string, not a tuple: every letter would be a name

    with pytest.raises(taskref.TaskError, match=r"Wrong.percent_metrics must be a tuple of metric names"):
        taskref.validate_class(Wrong, "x.py:Wrong")

    class Declared(MNIST):
        percent_metrics = ()

    assert taskref.validate_class(Declared, "x.py:Declared") is Declared


def test_a_task_file_of_the_same_name_and_class_is_the_same_task_wherever_it_lies(tmp_path: Path) -> None:
    """A project copied or moved with its runs relaunches with ``task=file.py:Name`` from its new place: the
    recorded absolute path of the old place names the same task (tests/test_checkpoint_gate.py resumes such a
    copy); another class, another file name or an import path is another task."""
    from ddp_slurm import taskref

    assert taskref.same("/old/place/line.py:Line", "line.py:Line")
    assert taskref.same("pkg.tasks:Line", "pkg.tasks:Line")
    assert not taskref.same("/old/place/line.py:Line", "line.py:Other")
    assert not taskref.same("/old/place/line.py:Line", "lines.py:Line")
    assert not taskref.same("/old/place/line.py:Line", "line:Line")


def test_a_copied_run_does_not_import_someone_else_s_task_file(tmp_path: Path) -> None:
    """``load_model`` and ``resume`` refuse another user's run folder with "copy the run to a directory of your
    own"; after ``cp -r`` the copy's config.yaml still names her task file by its absolute path. Copying must
    not launder trust: her file is imported only when named in DDP_SLURM_TRUST_TASK_FILE; a file every user
    can write is refused the same way."""
    import os
    import shutil

    from conftest import skip_or_fail

    if os.geteuid() != 0:
        skip_or_fail("needs root to give a file to another user")
    her = tmp_path / "her"
    her.mkdir()
    task = write_line_task(her)
    marker = tmp_path / "her-code-ran"
    task.write_text(task.read_text() + f"\nfrom pathlib import Path as _P\n_P({str(marker)!r}).write_text('ran')\n")
    made = Launcher(her).run(
        Launcher(her).cmd_train("task=line_task.py:Line", *LINE_RUN, "train.max_steps=4", "run.name=hers"), timeout=300
    )
    assert made.returncode == 0, made.stderr
    for path in (her, task, *her.rglob("*")):
        os.chown(path, 12345, 12345, follow_symlinks=False)
    mine = tmp_path / "mine"
    shutil.copytree(her / "runs", mine / "runs", symlinks=True)  # cp -r as me: the copy is mine, her task is not
    marker.unlink()
    ddp_slurm = [sys.executable, "-m", "ddp_slurm"]
    refused = Launcher(mine).run([*ddp_slurm, "resume", "runs/hers"], timeout=300)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"{task} is owned by uid 12345, not by you" in refused.stderr, refused.stderr
    assert f"DDP_SLURM_TRUST_TASK_FILE={task}" in refused.stderr
    assert not marker.exists()
    trusted = base_env(DDP_SLURM_TRUST_TASK_FILE=str(task))
    asked = subprocess.run(
        [*ddp_slurm, "resume", "runs/hers"], cwd=mine, env=trusted, capture_output=True, text=True, timeout=300
    )
    assert asked.returncode == 0 and "already finished at step 4" in asked.stderr, asked.stderr
    os.chown(her, 0, 0)
    os.chown(task, 0, 0)
    task.chmod(0o666)
    loose = Launcher(mine).run([*ddp_slurm, "resume", "runs/hers"], timeout=300)
    assert loose.returncode == 2 and "is writable by every user" in loose.stderr, loose.stderr


def test_tensors_unpack_into_the_tensors_given() -> None:
    """``x, y = task.eval_data()``: a fresh user could not unpack ``Tensors`` to feed an exported model."""
    from ddp_slurm import Tensors

    x, y = torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0])
    data = Tensors(x, y)
    first, second = data
    assert first is x and second is y and len(data) == 3 and data.tensors == (x, y)


TRAIN_LOG_TASK = """
from line_task import Line


class Logged(Line):
    def train_log(self):
        return {"temperature": 0.5, "seen": 7}


class Clashing(Line):
    def train_log(self):
        return {"lr": 1.0}
"""


def test_a_task_adds_numbers_to_the_train_lines(tmp_path: Path) -> None:
    """docs/loggers.md said a task could add fields to the train lines, and none could: ``train_log()`` does, and
    a name the line already has is one error line."""
    from ddp_slurm.train import metrics

    write_line_task(tmp_path)
    (tmp_path / "logged.py").write_text(TRAIN_LOG_TASK)
    launcher = Launcher(tmp_path)
    env = base_env(PYTHONPATH=f"{tmp_path}:{base_env()['PYTHONPATH']}")
    base = [*LINE_RUN, "train.max_steps=8"]
    ok = launcher.run(launcher.cmd_train("task=logged.py:Logged", *base, "run.name=logged"), env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    lines = [r for r in metrics.read(tmp_path / "runs/logged/metrics.jsonl") if r["kind"] == "train"]
    assert lines and all(r["temperature"] == 0.5 and r["seen"] == 7 and "loss" in r for r in lines), lines
    bad = launcher.run(launcher.cmd_train("task=logged.py:Clashing", *base, "run.name=clash"), env=env, timeout=300)
    assert bad.returncode == 2, bad.stderr
    assert "Clashing.train_log() returned lr, which the train line already has" in bad.stderr, bad.stderr
