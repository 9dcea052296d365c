"""Where training stands (``Position``), restored exactly from a checkpoint; the gathering of small per-rank
values on rank 0; the earliest file layout brought up to today's.

What a checkpoint holds beside the model and optimizer is a set of registered parts (``parts.py``, the standard
ones in ``standard.py``): the position is one of them. The data position is (epoch, step in epoch), see
``loader``: resuming at another world size continues with the same global batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class Position:
    """Where training stands; restored exactly from a checkpoint."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    elapsed_s: float = 0.0
    best: float | None = None
    best_step: int | None = None  # the step whose checkpoint holds ``best`` (kept outside checkpoint.keep)
    stale: int = 0  # evaluations in a row that did not beat ``best`` by more than eval.min_delta
    evaluated: int = 0  # the step of the last evaluation completed (one abandoned on a stop is redone)

    def advance(self) -> None:
        self.step += 1
        self.step_in_epoch += 1

    def next_epoch(self) -> None:
        self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def improve(self, value: float | None, higher_is_better: bool, min_delta: float = 0.0) -> bool:
        """Take an evaluation's value of the task's metric: whether it is a new best. ``stale`` counts
        the evaluations in a row that did not beat the best so far by more than ``min_delta``."""
        self.evaluated = self.step
        if value is None:
            return False
        gain = None if self.best is None else (value - self.best if higher_is_better else self.best - value)
        self.stale = 0 if gain is None or gain > min_delta else self.stale + 1
        if gain is None or gain > 0:
            self.best, self.best_step = value, self.step
            return True
        return False


def gather(obj: Any, rank: int, world_size: int, group: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere), through ``group`` (the host group); small pickled
    objects only."""
    if world_size == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A format-1 checkpoint file (this release's earliest layout) in today's shape."""
    if state.get("format", 1) >= 2:
        return state
    g = state["config"]["train"]["global_batch_size"]
    return dict(
        state,
        format=2,
        rng=[state["rng"]],
        task={},
        step_in_epoch=state["samples_in_epoch"] // g,
        best=state.get("best_accuracy"),
    )
