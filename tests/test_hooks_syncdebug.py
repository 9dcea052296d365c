"""DDP_SLURM_SYNC_DEBUG (train/hooks/syncdebug.py): the hook that runs the loop's steady steps under CUDA's sync
debug mode. On a GPU, tests/test_gpu_path.py runs the real loop with it; here, what holds anywhere: it
is off without CUDA or unset, it watches only from the warm-up's end, and a wrong value is named."""

from __future__ import annotations

import pytest
import torch

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
    with pytest.raises(ValueError, match="DDP_SLURM_SYNC_DEBUG='loud': expected one of warn, error"):
        syncdebug.SyncWatch("loud", 0)
