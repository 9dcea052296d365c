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
    line: LineData = field(default_factory=LineData)  # the section: line.size=..., line.noise=...


class Line(Task):
    """Fit y = 3x + 1."""

    Config = LineConfig
    best_metric = "mse"
    higher_is_better = False

    def check(self):
        if self.ctx.global_batch_size > self.config.line.size:
            raise ConfigError(
                f"train.global_batch_size={self.ctx.global_batch_size} > line.size={self.config.line.size}"
            )

    def points(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(n, 1, generator=g) * 2 - 1
        return x, 3 * x + 1 + self.config.line.noise * torch.randn(n, 1, generator=g)

    def build_model(self):
        return nn.Linear(1, 1)

    def train_data(self):
        return Tensors(*self.points(self.config.line.size, 0))

    def training_step(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    def eval_data(self):
        return Tensors(*self.points(100, 1))

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
