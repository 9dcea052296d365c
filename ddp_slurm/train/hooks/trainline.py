"""The ``train`` lines of metrics.jsonl: every ``train.log_every_steps`` steps, the loss (mean over the
window's steps and the ranks), samples per second, step time and its spread over the ranks
(``window.LossWindow``), the gradient norm before clipping (``accumulate.NormWindow``) and the learning
rate. The loss stays on the device in between: reading it is the one host sync per window.

The open window is a checkpoint part of its own (``train_window``, one per rank): a stop cuts a window, and the
resumed run (at the same world size) logs that window's line over all its steps, the very line of the run
left alone, so that ``report`` draws one curve for both. At another world size the window starts afresh."""

from __future__ import annotations

from typing import Any

import torch

from ddp_slurm import errors
from ddp_slurm.train import accumulate
from ddp_slurm.train.checkpoint.parts import Part, Stateful
from ddp_slurm.train.checkpoint.standard import count, number
from ddp_slurm.train.hooks.base import Hook, Training
from ddp_slurm.train.window import LossWindow


class TrainLine(Hook):
    def __init__(self, run: Any) -> None:
        self.run, self.every = run, run.cfg.train.log_every_steps
        self.window = self._window(run)
        self.norms = accumulate.NormWindow()  # train.grad_clip: the gradient norm before clipping
        self.saved: dict[str, Any] | None = None  # the window a checkpoint held, taken up at ``start``

    def parts(self) -> list[Part]:
        return [Stateful("train_window", self, per_rank=True, check=(window_state, "an open log window"))]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.run.pos.step, "loss": self.window.state_dict(), "grad_norm": self.norms.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state

    def start(self, t: Training) -> None:
        run, saved, self.saved = t.run, self.saved, None
        self.window, self.norms = self._window(run), accumulate.NormWindow()
        if saved is not None and saved["step"] == run.pos.step:  # taken at the step resumed at (or gone back to)
            self.window.load_state_dict(saved["loss"])
            self.norms.load_state_dict(saved["grad_norm"], run.device)

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


def window_state(value: Any) -> bool:
    """A ``TrainLine.state_dict`` as a checkpoint holds it (checked before it is used)."""
    if not isinstance(value, dict) or set(value) != {"step", "loss", "grad_norm"} or not count(value["step"]):
        return False
    loss, norm = value["loss"], value["grad_norm"]
    return (
        isinstance(loss, dict)
        and set(loss) == {"first_step", "n", "losses", "seconds"}
        and count(loss["first_step"])
        and count(loss["n"])
        and isinstance(loss["losses"], torch.Tensor)
        and loss["losses"].dim() == 1
        and loss["losses"].numel() <= loss["n"]
        and number(loss["seconds"])
        and isinstance(norm, dict)
        and set(norm) == {"sum", "n"}
        and count(norm["n"])
        and (norm["sum"] is None or (isinstance(norm["sum"], torch.Tensor) and norm["sum"].shape == (2,)))
    )


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
