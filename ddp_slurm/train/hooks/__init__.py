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

from typing import TYPE_CHECKING, Any

from ddp_slurm.train.hooks.base import Hook, Hooks, Training
from ddp_slurm.train.hooks.heartbeat import Heartbeat
from ddp_slurm.train.hooks.progress import ProgressDisplay
from ddp_slurm.train.hooks.slowranks import SlowRanks
from ddp_slurm.train.hooks.syncdebug import SyncDebug
from ddp_slurm.train.hooks.trainline import TrainLine

if TYPE_CHECKING:
    from ddp_slurm.train.run import Run

__all__ = ["Hook", "Hooks", "Training", "for_run", "standard"]


def standard(run: Run, dog: Any = None) -> Hooks:
    """The side features of every training run, in the order they are called."""
    return Hooks(
        [
            SyncDebug(run),  # DDP_SLURM_SYNC_DEBUG: no host sync inside a steady step (docs/gpu.md)
            Heartbeat(dog),  # the watchdog hears of every step (distributed/watchdog.py)
            TrainLine(run),  # the loss, rate and gradient-norm windows: metrics.jsonl's train lines
            SlowRanks(run),  # who is slow: each rank's compute per step at every train line (slurm.slow_factor)
            ProgressDisplay(run),  # rank 0's bar or plain progress lines
        ]
    )


def for_run(run: Run, dog: Any = None) -> Hooks:
    """The run's hooks: the standard ones, then the task's own (``Task.hooks``); each hook's checkpoint parts
    registered with the run (``run.parts``), before the checkpoint to resume from is judged and restored."""
    from ddp_slurm import errors
    from ddp_slurm.train.run import contributed

    found = standard(run, dog)
    for hook in run.task.hooks() or []:
        if not isinstance(hook, Hook):
            raise errors.UsageError(f"{type(run.task).__name__}.hooks() returned {hook!r:.60}: not a ddp_slurm.Hook")
        found.add(hook)
    for hook in found.hooks:
        for part in contributed(hook):
            try:
                run.parts.add(part)
            except ValueError as exc:
                raise errors.UsageError(f"{type(hook).__name__}: {exc}") from None
    return found
