"""Helpers shared by tests/test_tasks.py and tests/cluster/test_tasks_cluster.py.

``LINE_TASK`` is the source of a third, minimal task that nothing in the package names: a test
writes it to a file and selects it by path (``task=line_task.py:Line``), as a user would. The
example task lives in ``examples/addition``; ``ADDITION_TINY`` sizes it for tests (seconds, not
minutes: what is tested is the runtime, not how well it learns).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ADDITION = f"{REPO / 'examples' / 'addition' / 'task.py'}:Addition"

LINE_TASK = '''
"""A minimal ddp_slurm task: fit y = 3x + 1 with one linear layer, data held in memory."""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ddp_slurm import ConfigError, Task, Tensors, checked


@dataclass
class LineData:
    size: int = checked(256, check=lambda v: v >= 1, expected="an integer >= 1")
    """Training points."""
    noise: float = checked(0.01, check=lambda v: v >= 0, expected="a number >= 0")
    """Standard deviation of the noise on y."""


@dataclass
class LineConfig:
    line: LineData = field(default_factory=LineData)


class Line(Task):
    Config = LineConfig
    best_metric = "mse"
    higher_is_better = False

    def check(self):
        if self.ctx.global_batch_size > self.config.line.size:
            raise ConfigError(f"train.global_batch_size={self.ctx.global_batch_size} > line.size={self.config.line.size}")

    def _points(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(n, 1, generator=g) * 2 - 1
        return x, 3 * x + 1 + self.config.line.noise * torch.randn(n, 1, generator=g)

    def build_model(self):
        return nn.Linear(1, 1)

    def train_data(self):
        return Tensors(*self._points(self.config.line.size, 0))

    def training_step(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    def eval_data(self):
        return Tensors(*self._points(100, 1))

    def eval_step(self, model, batch):
        x, y = batch
        return {"mse": ((model(x) - y) ** 2).sum()}


class NotATask:
    """Looks like a task, is not a ddp_slurm.Task."""

    def build_model(self):
        return nn.Linear(1, 1)


class Incomplete(Task):
    """A Task without training_step."""

    def build_model(self):
        return nn.Linear(1, 1)

    def train_data(self):
        return Tensors(torch.zeros(4, 1))
'''

LINE_RUN = [
    "train.epochs=3",
    "train.global_batch_size=32",
    "train.optimizer=sgd",
    "train.lr=0.5",
    "train.schedule=constant",
    "train.log_every_steps=4",
]
"""A short Line training: 8 steps per epoch, 24 in all."""


def write_line_task(folder: Path) -> Path:
    path = folder / "line_task.py"
    path.write_text(LINE_TASK)
    return path


def addition_tiny(
    epochs: int = 2, global_batch: int = 64, train_size: int = 2048, data_root: str = "data"
) -> list[str]:
    """The addition example sized for a test: ``train_size // global_batch`` steps per epoch, a small
    model (dropout and the operand swap on), the Dataset path with 2 workers per rank."""
    return [
        f"task={ADDITION}",
        f"data.train_size={train_size}",
        "data.test_size=256",
        f"data.root={data_root}",
        "model.width=32",
        "model.layers=1",
        "model.dropout=0.2",
        "data.swap_prob=0.5",
        "train.workers=2",
        f"train.epochs={epochs}",
        f"train.global_batch_size={global_batch}",
        "train.lr=3e-3",
        "train.log_every_steps=2",
        "checkpoint.every_steps=10",
        "checkpoint.keep=100",
    ]
