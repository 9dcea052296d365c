"""The ``train`` lines of metrics.jsonl: every ``train.log_every_steps`` steps, the loss (mean over the
window's steps and the ranks), samples per second, step time and its spread over the ranks
(``window.LossWindow``), the gradient norm before clipping (``accumulate.NormWindow``) and the learning
rate. The loss stays on the device in between: reading it is the one host sync per window."""

from __future__ import annotations

from typing import Any

import torch

from ddp_slurm import errors
from ddp_slurm.train import accumulate
from ddp_slurm.train.hooks.base import Hook, Training
from ddp_slurm.train.window import LossWindow


class TrainLine(Hook):
    def __init__(self, run: Any) -> None:
        self.every = run.cfg.train.log_every_steps
        self.window = self._window(run)
        self.norms = accumulate.NormWindow()  # train.grad_clip: the gradient norm before clipping

    def start(self, t: Training) -> None:
        self.window = self._window(t.run)

    @staticmethod
    def _window(run: Any) -> LossWindow:
        return LossWindow(run.device, run.world_size, run.cfg.train.global_batch_size, run.pos.step, run.groups.train)

    def wants_host(self, step: int) -> bool:
        return step % self.every == 0

    def after_step(self, t: Training, loss: torch.Tensor) -> None:
        run = t.run
        self.window.add(loss)
        self.norms.add(getattr(run.train_step, "grad_norm", None))
        if run.pos.step % self.every == 0:
            figures = self.window.close(run.pos.step)
            t.loss, t.rate = self.window.loss, self.window.rate
            fields = {
                **figures,
                **self.norms.close(),
                "world_size": run.world_size,
                "lr": run.scheduler.get_last_lr()[0],
            }
            if run.env.rank == 0:  # only rank 0 writes the line: the others need not ask
                fields |= task_fields(run.task, fields)
            t.metrics.write("train", run.pos.step, run.pos.epoch, t.elapsed(), **fields)


def task_fields(task: Any, ours: dict[str, Any]) -> dict[str, float]:
    """``task.train_log()`` as numbers; UsageError (one line, naming the task) for a name the line already has
    or a value that is not a number."""
    given = task.train_log() or {}
    taken = sorted(set(given) & ({"kind", "step", "epoch", "time_s"} | set(ours)))
    if taken:
        raise errors.UsageError(
            f"{type(task).__name__}.train_log() returned {', '.join(taken)}, which the train line already has: rename them"
        )
    out = {}
    for name, value in given.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
            raise errors.UsageError(
                f"{type(task).__name__}.train_log() returned {name!r}: {value!r:.40}; expected names and numbers"
            )
        out[name] = value.item() if isinstance(value, torch.Tensor) else value
    return out
