"""``dist.strategy`` (``train/strategy.py``): chosen once, asked everywhere; what each strategy does with a
model the other would take as it is."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import Launcher

from ddp_slurm.train import strategy
from ddp_slurm.train.checkpoint.backends import Sharded, WholeFile


def test_each_strategy_names_its_checkpoint_backend_and_what_graphs_can_capture() -> None:
    ddp, fsdp = strategy.of("ddp"), strategy.of("fsdp")
    assert (ddp.name, type(ddp.backend), ddp.captures_graphs) == ("ddp", WholeFile, True)
    assert (fsdp.name, type(fsdp.backend), fsdp.captures_graphs) == ("fsdp", Sharded, False)


def train(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return Launcher(cwd).run(Launcher(cwd).cmd_train(*overrides))


def test_fsdp_trains_the_default_cnn_whose_weights_are_channels_last(tmp_path: Path) -> None:
    """Audit break 7: the documented ``dist.strategy=fsdp`` with the default cnn raised NotImplementedError on
    every rank (DTensor cannot shard channels_last weights) and left a junk run directory."""
    res = train(
        tmp_path, "dist.strategy=fsdp", "model.name=cnn", "train.max_steps=4", "train.schedule=constant", "run.name=cnn"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "finished: 4 steps" in res.stderr


UNWRAPPABLE = '''
import torch
from ddp_slurm.tasks.mnist.task import MNIST


class Stray(MNIST):
    """Names a shard unit that is not part of its model: FSDP cannot wrap it."""

    def shard_units(self, model):
        return [torch.nn.Linear(2, 2)]
'''


def test_a_model_the_strategy_cannot_wrap_fails_before_the_run_directory_exists(tmp_path: Path) -> None:
    """The run's objects are built before the run directory is taken: a failure there leaves nothing behind."""
    (tmp_path / "stray.py").write_text(UNWRAPPABLE)
    res = train(tmp_path, "task=stray.py:Stray", "dist.strategy=fsdp", "model.name=mlp", "run.name=stray")
    assert res.returncode == 1 and "not a submodule of the model" in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "runs").exists()
