"""DDP_SLURM_SYNC_DEBUG (train/hooks/syncdebug.py): the hook that runs the loop's steady steps under CUDA's sync
debug mode. On a GPU, tests/test_gpu_path.py runs the real loop with it; here, what holds anywhere: it
is off without CUDA or unset, it watches only from the warm-up's end, a wrong value is named, and torch's
mode follows the watch's flag through a pause and a rollback's new start (with torch.cuda's mode standing
in for a GPU's). The guard's rollbacks under it: tests/test_guard.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import Launcher, base_env

from ddp_slurm.errors import UsageError
from ddp_slurm.train.hooks import Hooks, syncdebug


def test_off_on_cpu_and_when_unset() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert syncdebug.SyncWatch.from_environ({syncdebug.ENV: "error"}, cpu, 0).mode is None
    assert syncdebug.SyncWatch.from_environ({}, gpu, 0).mode is None
    assert syncdebug.SyncWatch.from_environ({syncdebug.ENV: "error"}, gpu, 7).mode == "error"
    watch = syncdebug.SyncWatch(None, 0)
    for step in range(10):
        watch.steady(step)
        watch.boundary()
    watch.close()
    assert watch.watched == 0 and not watch.on


def test_the_watch_starts_after_the_warm_up_of_each_launch() -> None:
    watch = syncdebug.SyncWatch("warn", first_step=100)  # a resumed launch: its own warm-up
    assert watch.start == 100 + syncdebug.WARMUP_STEPS
    watch.steady(100)  # a warm-up step: nothing switched on (no CUDA call made)
    assert watch.watched == 0 and not watch.on


def test_a_wrong_value_is_named() -> None:
    with pytest.raises(UsageError, match="DDP_SLURM_SYNC_DEBUG='loud': expected one of warn, error"):
        syncdebug.SyncWatch("loud", 0)
    with pytest.raises(UsageError, match="DDP_SLURM_SYNC_DEBUG='on'"):  # on CPU too: the value is wrong anywhere
        syncdebug.SyncWatch.from_environ({syncdebug.ENV: "on"}, torch.device("cpu"), 0)
    assert syncdebug.mode_from({syncdebug.ENV: ""}) is None


def test_a_wrong_value_stops_training_before_the_run_directory_exists(launcher: Launcher) -> None:
    res = launcher.run(
        launcher.cmd_train("model.name=mlp", "run.name=sd"), timeout=120, env=base_env(DDP_SLURM_SYNC_DEBUG="raise")
    )
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == ["ddp_slurm.train: error: DDP_SLURM_SYNC_DEBUG='raise': expected one of warn, error (or unset)"]
    assert not (launcher.cwd / "runs").exists()


def test_torchs_mode_follows_the_watch_through_a_pause_and_a_rollbacks_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard rolls back at a step that is not a boundary, with the watch on: it waits for the device inside
    ``paused`` (off, then back on), and the hooks' ``start`` that follows begins a new warm-up with the watch
    off, flag and torch's mode together. There is no GPU here: torch.cuda's mode is held by the test (a
    stand-in for a GPU's), and the hook believes its device is CUDA."""
    mode = [0]
    names = {"default": 0, "warn": 1, "error": 2}
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__(0, names.get(m, m)))
    monkeypatch.setenv(syncdebug.ENV, "error")
    pos = SimpleNamespace(step=0)
    t = SimpleNamespace(run=SimpleNamespace(device=torch.device("cuda", 0), pos=pos))
    hook = syncdebug.SyncDebug(t.run)
    hooks = Hooks([hook])
    for pos.step in range(6):  # before steps 1-6: watched from the 4th
        hooks.before_step(t)
    assert (hook.watch.on, mode[0]) == (True, 2)
    hooks.start(t)  # a rollback's new start, at the step gone back to
    assert (hook.watch.on, mode[0]) == (False, 0), "the flag says off and torch's mode stays 'error'"
    for pos.step in range(5, 9):
        hooks.before_step(t)
        assert mode[0] == (2 if pos.step >= 8 else 0)  # a new warm-up from step 5: watched from step 9
    with syncdebug.paused(hooks):
        assert mode[0] == 0 and hook.watch.on  # the guard's rollback and verdict wait in here
        with syncdebug.paused(hooks):
            assert mode[0] == 0
        assert mode[0] == 0
    assert mode[0] == 2  # back on: the next steady step is watched
    with syncdebug.paused(hooks):
        hooks.start(t)  # a start inside a pause: off when the pause ends
    assert (hook.watch.on, mode[0]) == (False, 0)
    hooks.before_step(t)  # a new warm-up from step 8
    assert mode[0] == 0
    hook.end(t)
    assert hook.watch.watched == 3 + 1  # steps 4-6 before the rollback, step 9 after: counted over the launch
    with syncdebug.paused(Hooks([])):  # no watch: nothing to pause
        pass
