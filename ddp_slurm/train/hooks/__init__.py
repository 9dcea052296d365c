"""Side features beside the training loop (torchtnt's callbacks are the model): each is a ``Hook`` in a
file of its own, and joins the loop with one line in ``standard`` below; the loop never names one.

The loop calls every hook, in registration order, at these points of a rank's run:

- ``start``: once, before the first step (after a resume, at the step resumed from);
- ``epoch_start`` / ``epoch_end``: around each epoch's steps (``epoch_end`` before its evaluation);
- ``before_step`` / ``stepped``: before each optimizer step, and right after it (before the ranks agree
  on how it went: nothing may wait for the device or the other ranks there);
- ``wants_host(step)``: whether the hook reads device values after ``step`` (a log line): the loop then
  calls ``boundary`` before anything there may wait for the device (and always before a save);
- ``after_step(loss)``: after each step, once the ranks agreed it went well (``loss`` stays on the device);
- ``end``: once, on every way out of the loop (finished, stopped, or an error on the way).

Every hook runs on every rank (a hook that logs keeps quiet off rank 0 itself), so a hook may use a
collective at a step every rank reaches. The figures a hook publishes for others (the loss and rate of
the last log window) live on ``Training``, the loop's view that every hook gets.

Adding a feature: a new file with one ``Hook`` subclass, and one line in ``standard``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ddp_slurm.train.metrics import MetricsWriter
    from ddp_slurm.train.run import Run


@dataclass
class Training:
    """What hooks see of the loop: the run's objects, where metrics go, the clock, shared figures."""

    run: Run
    metrics: MetricsWriter
    started: float = field(default_factory=time.monotonic)
    loss: float | None = None
    """The training loss of the last log window (mean over its steps and the ranks), on the host."""
    rate: float | None = None
    """Samples per second over the last log window."""

    def elapsed(self) -> float:
        """Training time so far, over every launch of the run."""
        return self.run.pos.elapsed_s + time.monotonic() - self.started

    def eta(self) -> float | None:
        run = self.run
        return (run.total_steps - run.pos.step) * run.cfg.train.global_batch_size / self.rate if self.rate else None


class Hook:
    """A side feature (see the module docstring); every method is optional."""

    def start(self, t: Training) -> None: ...

    def epoch_start(self, t: Training) -> None: ...

    def before_step(self, t: Training) -> None: ...

    def stepped(self, t: Training) -> None: ...

    def wants_host(self, step: int) -> bool:
        return False

    def boundary(self, t: Training) -> None: ...

    def after_step(self, t: Training, loss: torch.Tensor) -> None: ...

    def epoch_end(self, t: Training) -> None: ...

    def end(self, t: Training) -> None: ...


class Hooks:
    """The registered hooks, called in order."""

    def __init__(self, hooks: Iterable[Hook]) -> None:
        self.hooks = list(hooks)

    def __getattr__(self, point: str) -> Any:
        if point.startswith("_"):
            raise AttributeError(point)

        def call(*args: Any) -> None:
            for hook in self.hooks:
                getattr(hook, point)(*args)

        return call

    def wants_host(self, step: int) -> bool:
        return any(hook.wants_host(step) for hook in self.hooks)


def standard(run: Run, dog: Any = None) -> Hooks:
    """The side features of every training run, in the order they are called."""
    from ddp_slurm.train.hooks.heartbeat import Heartbeat
    from ddp_slurm.train.hooks.progress import ProgressDisplay
    from ddp_slurm.train.hooks.syncdebug import SyncDebug
    from ddp_slurm.train.hooks.trainline import TrainLine

    return Hooks(
        [
            SyncDebug(run),  # DDP_SLURM_SYNC_DEBUG: no host sync inside a steady step (docs/gpu.md)
            Heartbeat(dog),  # the watchdog hears of every step (distributed/watchdog.py)
            TrainLine(run),  # the loss, rate and gradient-norm windows: metrics.jsonl's train lines
            ProgressDisplay(run),  # rank 0's bar or plain progress lines
        ]
    )
