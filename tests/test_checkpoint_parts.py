"""What a checkpoint holds is a set of registered parts (``train/checkpoint/parts.py``, ``standard.py``): the
registry's rules, today's on-disk keys kept, a side feature with state added by one file and one registration
(nothing in ``train/checkpoint/`` touched) surviving SIGUSR2 and a relaunch, the log window a stop cuts
logged as the run left alone logs it, and a checkpoint of the layout before parts resuming exactly."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helpers
import pytest
import torch
from conftest import Launcher, base_env
from tasks_helpers import LINE_TASK
from test_fsdp import assert_same_state, launches  # noqa: F401  (the fixture)
from test_resume import Launch, assert_resumed_from, assert_stopped, run_to_end, start

from ddp_slurm import Stateful
from ddp_slurm.train import checkpoint, metrics
from ddp_slurm.train.checkpoint import schema
from ddp_slurm.train.checkpoint.backends import WholeFile
from ddp_slurm.train.checkpoint.parts import Moment, Parts, Restoring
from ddp_slurm.train.checkpoint.standard import standard as standard_parts

LEGACY = Path(__file__).parent / "data" / "legacy"
"""A run of the Line task (``line_task.py``, frozen) checkpointed at step 6 of 24 by the release before parts:
its ``step-6.pt`` and ``config.yaml``."""

# The keys a whole-file checkpoint held before parts, as that release wrote them (its step-6.pt holds these).
EARLIER_KEYS = {
    "best", "best_step", "config", "elapsed_s", "epoch", "evaluated", "finished", "format", "guard", "model",
    "optimizer", "restart_count", "rng", "scaler", "scheduler", "stale", "step", "step_in_epoch", "task", "world_size",
}  # fmt: skip

# A side feature as a user adds one: one file (the task's), one registration (``hooks()``). Each rank sums its own
# losses on the host (a per-rank part); rank 1 sends itself SIGUSR2 at step STOP_AT on the first launch.
TALLY_TASK = (
    LINE_TASK
    + """

import os
import signal

from ddp_slurm import Hook, Stateful


class Tally(Hook):
    def __init__(self):
        self.steps, self.total = 0, 0.0

    def parts(self):
        return [Stateful("tally", self, per_rank=True)]

    def state_dict(self):
        return {"steps": self.steps, "total": self.total}

    def load_state_dict(self, state):
        self.steps, self.total = state["steps"], state["total"]

    def after_step(self, t, loss):
        self.steps, self.total = self.steps + 1, self.total + float(loss)
        if t.run.rank == 1 and t.run.pos.step == int(os.environ.get("STOP_AT", "-1")):
            os.kill(os.getpid(), signal.SIGUSR2)


class TallyLine(Line):
    def hooks(self):
        return [Tally()]
"""
)
TALLY_RUN = [
    "task=tally_task.py:TallyLine",
    "train.epochs=3",
    "train.global_batch_size=32",
    "train.optimizer=sgd",
    "train.lr=0.5",
    "train.schedule=constant",
    "train.log_every_steps=5",
    "checkpoint.every_steps=0",
    "run.name=r",
]


class Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


HOW = Restoring(rank=1, world_size=2, seed=0, device=torch.device("cpu"))


def test_a_part_registered_after_the_restore_gets_its_value_and_a_key_is_one_part_s() -> None:
    parts = Parts([Stateful("a", Counter())])
    parts.put({"a": {"n": 1}, "b": {"n": 7}, "c": [{"n": 3}, {"n": 4}], "model": {"w": 0}}, HOW, owned={"model"})
    late, mine = Counter(), Counter()
    parts.add(Stateful("b", late))
    parts.add(Stateful("c", mine, per_rank=True))
    assert (late.n, mine.n) == (7, 4)  # rank 1's own value
    with pytest.raises(ValueError, match="key.s. b are taken"):
        parts.add(Stateful("b", Counter()))
    parts.put({"c": [{"n": 3}]}, HOW)  # saved at world size 1: rank 1 keeps its fresh state
    assert mine.n == 4
    bad = Parts()
    bad.put({"d": "not a mapping"}, HOW)
    with pytest.raises(ValueError, match="its d is not a mapping"):
        bad.add(Stateful("d", Counter()))


def test_a_part_s_values_are_gathered_per_rank_and_checked_like_the_standard_keys() -> None:
    parts = Parts([Stateful("a", Counter(5)), Stateful("c", Counter(2), per_rank=True)])
    record = parts.take(Moment(), lambda own: [own, {"c": {"n": 9}}])
    assert record == {"a": {"n": 5}, "c": [{"n": 2}, {"n": 9}]}
    required, optional = parts.checks()
    assert required == {} and set(optional) == {"a", "c"}
    good = WholeFile().capture(_stand_in(), False, 0.0, {})
    schema.check(good | {"c": [{"n": 1}]}, parts=(schema.RESUMABLE, {**schema.OPTIONAL, **optional}))
    with pytest.raises(ValueError, match="its c is not a list of a mapping, one per rank"):
        schema.check(good | {"c": {"n": 1}}, parts=(schema.RESUMABLE, {**schema.OPTIONAL, **optional}))


def test_the_standard_parts_write_the_keys_the_release_before_them_wrote() -> None:
    record = WholeFile().capture(_stand_in(), False, 1.5, {})
    assert set(record) == EARLIER_KEYS
    assert set(schema.RESUMABLE) | set(schema.OPTIONAL) | WholeFile.owns == EARLIER_KEYS
    saved = checkpoint.load(LEGACY / "step-6.pt")
    assert set(saved) == EARLIER_KEYS and saved["step"] == 6 and not saved["finished"]


def test_a_side_feature_with_state_and_the_cut_log_window_survive_sigusr2_and_a_relaunch(
    launches: list[Launch],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Two ranks; the task's hook (``Tally``) sums each rank's losses; rank 1 stops the run with SIGUSR2 inside
    a log window. The relaunch ends with the weights, the optimizer state and every rank's tally of the run
    left alone, and every ``train`` line of both launches, the window the stop cut too, equal to its."""
    for folder in (tmp_path, tmp_path / "ref"):
        folder.mkdir(exist_ok=True)
        (folder / "tally_task.py").write_text(TALLY_TASK)
    reference = run_to_end(launches, tmp_path / "ref", 2, TALLY_RUN)
    first = start(launches, tmp_path, 2, TALLY_RUN, env=base_env(STOP_AT="7"))
    stop = assert_stopped(first)["step"]
    assert stop % 5 and stop < 24, stop  # inside a window, with steps to go
    second = run_to_end(launches, tmp_path, 2, TALLY_RUN)
    assert_resumed_from(second, stop)
    assert_same_state(first.run_dir, reference.run_dir)
    got, want = checkpoint.load_latest(first.run_dir), checkpoint.load_latest(reference.run_dir)
    assert got is not None and want is not None
    assert got["tally"] == want["tally"] and [t["steps"] for t in want["tally"]] == [24, 24], got["tally"]
    assert got["tally"][0] != got["tally"][1]  # each rank its own
    assert _train_lines(first.run_dir) == _train_lines(reference.run_dir)
    assert sorted(_train_lines(first.run_dir)) == [5, 10, 15, 20]


def test_a_checkpoint_of_the_layout_before_parts_resumes_exactly(tmp_path: Path) -> None:
    """The release before parts checkpointed the Line task at step 6: resumed here, it ends with the weights of a
    run of this release left alone from step 0 (no window, no tally: parts it did not have start fresh)."""
    args = [
        "task=line_task:Line",
        "train.epochs=3",
        "train.global_batch_size=32",
        "train.optimizer=sgd",
        "train.lr=0.5",
        "train.schedule=constant",
        "train.log_every_steps=4",
        "checkpoint.every_steps=6",
        "checkpoint.keep=100",
        "run.name=legacy",
    ]
    states = []
    for name, resumed in (("old", True), ("new", False)):
        cwd = tmp_path / name
        (cwd / "runs" / "legacy" / "checkpoints").mkdir(parents=True)
        shutil.copy(LEGACY / "line_task.py", cwd)
        if resumed:
            shutil.copy(LEGACY / "config.yaml", cwd / "runs" / "legacy")
            shutil.copy(LEGACY / "step-6.pt", cwd / "runs" / "legacy" / "checkpoints")
        env = base_env(PYTHONPATH=f"{cwd}:{base_env()['PYTHONPATH']}")
        Launcher(cwd).run(Launcher(cwd).cmd_train(*args), env=env, check=True)
        rows = list(metrics.read(cwd / "runs" / "legacy" / "metrics.jsonl"))
        assert (rows[0]["resumed"], rows[0]["step"]) == (resumed, 6 if resumed else 0), rows[0]
        states.append(checkpoint.load_latest(cwd / "runs" / "legacy"))
    old, new = states
    assert old["step"] == new["step"] == 24 and old["finished"]
    assert all(torch.equal(t, new["model"][k]) for k, t in old["model"].items())


def _train_lines(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics.read(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def _stand_in() -> Any:
    from ddp_slurm import config
    from ddp_slurm.tasks.mnist import models
    from ddp_slurm.train.optim import make_optimizer, make_scheduler

    cfg = config.Config()
    model = models.build("mlp")
    optimizer = make_optimizer(cfg.train, model.parameters(), torch.device("cpu"))
    scheduler = make_scheduler(cfg.train, optimizer, 10)
    return helpers.run_objects(model, optimizer, scheduler, cfg=cfg, env=SimpleNamespace(restart_count=0))


def test_a_task_s_hooks_are_hooks_and_their_parts_keys_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Task.hooks`` returning something else, or a hook's part taking a key a part already has: one line
    (UsageError, exit 2) naming the task or the hook, before anything is judged or restored."""
    from ddp_slurm import Hook, errors
    from ddp_slurm.train import hooks

    class Twice(Hook):
        def parts(self) -> list[Any]:
            return [Stateful("scheduler", Counter())]  # the standard Schedule part's key

    class Task:
        def __init__(self, made: list[Any]) -> None:
            self.made = made

        def hooks(self) -> list[Any]:
            return self.made

    monkeypatch.setattr(hooks, "standard", lambda run, dog=None: hooks.Hooks([]))
    run = _stand_in()
    run.parts = standard_parts(run)
    for made, says in (([object()], r"Task.hooks\(\) returned <object .*: not a ddp_slurm.Hook"), ([Twice()], "Twice")):
        run.task = Task(made)
        with pytest.raises(errors.UsageError, match=says):
            hooks.for_run(run)

    class Kept(Hook):
        def parts(self) -> list[Any]:
            return [Stateful("kept", Counter())]

    run.task = Task([Kept()])
    assert isinstance(hooks.for_run(run).hooks[0], Kept) and "kept" in run.parts.checks()[1]


def test_each_backend_says_which_paths_it_holds(tmp_path: Path) -> None:
    """``backend_at`` asks each on-disk half (no guess from ``is_dir``): a ``*.pt`` file is a whole file, a folder
    with a commit record a folder of shards, anything else neither (one line); the kinds are formats."""
    from ddp_slurm.train.checkpoint.backends import Sharded, backend_at

    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / "commit.pt").write_bytes(b"")
    (tmp_path / "step-4.pt").write_bytes(b"")
    (tmp_path / "notes").mkdir()
    assert isinstance(backend_at(tmp_path / "step-3"), Sharded) and backend_at(tmp_path / "step-3").kind == "sharded"
    assert isinstance(backend_at(tmp_path / "step-4.pt"), WholeFile) and WholeFile.kind == "whole-file"
    for neither in ("notes", "model.bin"):
        with pytest.raises(ValueError, match="neither a checkpoint file"):
            backend_at(tmp_path / neither)
