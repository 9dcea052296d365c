"""DDP_SLURM_SYNC_DEBUG (train/hooks/syncdebug.py): the hook that runs the loop's steady steps under CUDA's sync
debug mode. On a GPU, tests/test_gpu_path.py runs the real loop with it; here, what holds anywhere: it
is off without CUDA or unset, it watches only from the warm-up's end, and a wrong value is named."""

from __future__ import annotations

import pytest
import torch
from conftest import Launcher, base_env

from ddp_slurm.errors import UsageError
from ddp_slurm.train.hooks import syncdebug


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
