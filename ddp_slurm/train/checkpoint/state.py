"""What a checkpoint holds, whatever its backend (a whole file or a folder of shards), and the position.

A checkpoint holds everything a task needs to continue bit-identically: the model and the optimizer
(the backend's part: rank 0's whole state dicts in a file, or every rank's shards), and ``record``:
the schedule, the task's own ``state_dict``, the position (step, epoch, step in epoch), every rank's
RNG streams (``rng.py``), the best metric (its value and step, and early stopping's count of
evaluations without improvement), the step of the last evaluation completed, the world size, the
guard's state (its loss statistics, skipped steps and rollbacks: ``guard/``), and the run's config. The data position is (epoch, step in epoch), see ``loader``. ``resume`` puts a record
back on every rank.

Resuming at another world size: the model, optimizer, schedule, position and task state carry over
unchanged and the data continues with the same global batches (see ``loader``); RNG streams belong to
ranks, so ranks that had no counterpart start fresh streams seeded from ``(seed, rank, step)`` and the
run continues exactly, though not bit-identically with a run that kept its world size (dropout masks
differ).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.train import rng

log = logging.getLogger("ddp_slurm")


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
    guard: dict[str, Any] = field(default_factory=dict)
    """The guard's state (``guard/``): the loss's running mean and deviation and how many steps fed them, the
    skipped steps, the rollbacks made. Empty until the guard writes it."""

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


def record(
    scheduler: Any,
    task: Any,
    pos: Position,
    finished: bool,
    elapsed_s: float,
    rngs: list[Any],
    world_size: int,
    scaler: Any = None,
) -> dict[str, Any]:
    """What every checkpoint holds beside the model and optimizer, whatever its backend: schedule, task
    state, position, every rank's RNG streams, and fp16's gradient scaler (None without one)."""
    return {
        "scaler": None if scaler is None else scaler.state_dict(),
        "scheduler": scheduler.state_dict(),
        "task": task.state_dict(),
        "step": pos.step,
        "epoch": pos.epoch,
        "step_in_epoch": pos.step_in_epoch,
        "finished": finished,
        "elapsed_s": elapsed_s,
        "best": pos.best,
        "best_step": pos.best_step,
        "stale": pos.stale,
        "evaluated": pos.evaluated,
        "rng": rngs,
        "world_size": world_size,
        "guard": dict(pos.guard),
    }


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


def resume(
    record: dict[str, Any],
    scheduler: Any,
    task: Any,
    seed: int,
    device: torch.device,
    rank: int,
    world_size: int,
    what: str,
    changed: str,
    scaler: Any = None,
) -> Position:
    """What follows the model and optimizer, for every backend: the schedule, fp16's gradient scaler, the
    task's own state, this rank's RNG streams (fresh ones at another world size, with one warning saying
    what ``changed``), and the position to continue from."""
    scheduler.load_state_dict(record["scheduler"])
    if scaler is not None and record.get("scaler"):  # the same precision: the run's config says so
        scaler.load_state_dict(record["scaler"])
    task.load_state_dict(record["task"])
    if len(record["rng"]) == world_size:
        rng.set_rng_state(record["rng"][rank], device)
    else:
        rng.seed_rank(seed, rank, record["step"], device)
        if rank == 0:
            log.warning(
                "resuming at world size %d from %s of world size %d: %s",
                world_size,
                what,
                len(record["rng"]),
                changed,
            )
    return Position(
        step=record["step"],
        epoch=record["epoch"],
        step_in_epoch=record["step_in_epoch"],
        elapsed_s=record["elapsed_s"],
        best=record["best"],
        # checkpoints of earlier versions: the best's step unknown, no early-stopping count, nothing to redo
        best_step=record.get("best_step"),
        stale=record.get("stale", 0),
        evaluated=record.get("evaluated", record["step"]),
        guard=dict(record.get("guard") or {}),
    )
