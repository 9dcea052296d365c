"""train/rundir.py: how new runs are named, and a run directory that holds no work yet."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddp_slurm import config
from ddp_slurm.distributed.groups import Groups
from ddp_slurm.tasks.mnist import models
from ddp_slurm.train import rundir, runname
from ddp_slurm.train.checkpoint import Checkpointer
from ddp_slurm.train.checkpoint.backends import WholeFile
from ddp_slurm.train.optim import make_optimizer

NOON = time.mktime((2026, 12, 3, 12, 0, 0, 0, 0, -1))


def test_a_new_run_is_named_for_its_task_and_time_and_never_reuses_a_directory(tmp_path: Path) -> None:
    cfg = config.load(None, [f"run.output_root={tmp_path}"])
    first = runname.new_name(cfg, NOON)
    assert first == "mnist-20261203-120000"
    (tmp_path / first).mkdir()
    assert runname.new_name(cfg, NOON) == "mnist-20261203-120000-2"  # two launches in one second


def test_inside_slurm_the_job_names_the_run_so_a_requeue_continues_it() -> None:
    cfg = config.load(None, [])
    assert runname.job_name(cfg, "4242") == "mnist-4242"
    assert runname.job_name(cfg, "77_3") == "mnist-77_3"  # an array task
    assert runname.job_name(cfg, None) is None


def test_a_user_task_names_its_runs(tmp_path: Path) -> None:
    cfg = config.load(None, ["task=ddp_slurm.tasks.mnist:MNIST"])
    cfg.task = "my_project.tasks:Digits"  # the name only: nothing is imported here
    assert runname.base_name(cfg) == "digits"


@pytest.mark.parametrize("first, second", [("train.epochs=1", "train.epochs=2")])
def test_a_directory_without_checkpoints_takes_new_settings(tmp_path: Path, first: str, second: str) -> None:
    """A launch that failed before its first checkpoint (missing data, a typo) locks nothing in."""
    base = [f"run.output_root={tmp_path}", "run.name=r"]
    for override in (first, second):
        cfg = config.load(None, [*base, override])
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        lock = rundir.RunLock(cfg.paths)
        model = models.build("mlp")
        optimizer = make_optimizer(cfg.train, model.parameters(), torch.device("cpu"))
        run = SimpleNamespace(model=model, optimizer=optimizer, rank=0, world_size=1, groups=Groups())
        ckpt = Checkpointer(cfg.checkpoint, cfg.paths, WholeFile(), run, cfg)
        try:
            assert rundir.take(cfg, lock, ckpt) is None
        finally:
            lock.release()
    assert config.read_resolved(tmp_path / "r" / "config.yaml").train.epochs == 2
