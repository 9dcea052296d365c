"""Training position <-> checkpoint state, in one place.

A checkpoint holds everything a task needs to continue bit-identically: the model (rank 0's, without
DDP's ``module.`` prefix), the optimizer and the schedule, the position (step, epoch, step in epoch),
every rank's RNG streams (python, numpy, torch, and the rank's own CUDA device) and the task's own
``state_dict``; the data position is (epoch, step in epoch), see ``loader``. Rank 0 writes it; each rank reads back its own part.

Resuming at another world size: the model, optimizer, schedule, position and task state carry over
unchanged and the data continues with the same global batches (see ``loader``); RNG streams belong to
ranks, so ranks that had no counterpart start fresh streams seeded from
``(seed, rank, step)`` and the run continues exactly, though not bit-identically with a run that kept its
world size (dropout masks differ).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.train.checkpoint.format import FORMAT

log = logging.getLogger("ddp_slurm")


@dataclass
class Position:
    """Where training stands; restored exactly from a checkpoint."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    elapsed_s: float = 0.0
    best: float | None = None
    last_saved: int = -1

    def advance(self) -> None:
        self.step += 1
        self.step_in_epoch += 1

    def next_epoch(self) -> None:
        self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def improve(self, value: float | None, higher_is_better: bool) -> None:
        if value is None:
            return
        if self.best is None or (value > self.best if higher_is_better else value < self.best):
            self.best = value


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG streams; CUDA: only this rank's own device (another job may see more or fewer GPUs)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:  # as tensors and plain values: checkpoints load with weights_only (no numpy arrays in them)
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_rank(seed: int, rank: int, step: int, device: torch.device) -> None:
    """Fresh, distinct RNG streams for ``rank`` (start of a run, or a rank new at a resume)."""
    s = (seed * 1_000_003 + step) * 65_537 + rank
    random.seed(s)
    torch.manual_seed(s)  # seeds every CUDA device too
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(s & 0xFFFF_FFFF)


def gather(obj: Any, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere); small pickled objects only."""
    if world_size == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def capture(
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    task: Any,
    pos: Position,
    finished: bool,
    elapsed_s: float,
    extra: dict[str, Any],
    device: torch.device,
    rank: int,
    world_size: int,
) -> dict[str, Any] | None:
    """The checkpoint state on rank 0 (None on the others, which only contribute their RNG streams).

    A collective: every rank calls it at the same step.
    """
    rngs = gather(rng_state(device), rank, world_size)
    if rank != 0:
        return None
    assert rngs is not None
    own = {"format": FORMAT, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return own | record(scheduler, task, pos, finished, elapsed_s, rngs, world_size) | extra


def record(
    scheduler: Any, task: Any, pos: Position, finished: bool, elapsed_s: float, rngs: list[Any], world_size: int
) -> dict[str, Any]:
    """What every checkpoint holds beside the model and optimizer, whatever its format (a single file here,
    a sharded folder's commit record in ``checkpoint/sharded.py``): schedule, task state, position, every
    rank's RNG streams."""
    return {
        "scheduler": scheduler.state_dict(),
        "task": task.state_dict(),
        "step": pos.step,
        "epoch": pos.epoch,
        "step_in_epoch": pos.step_in_epoch,
        "finished": finished,
        "elapsed_s": elapsed_s,
        "best": pos.best,
        "rng": rngs,
        "world_size": world_size,
    }


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A format-1 checkpoint (this release's earlier layout) in today's shape."""
    if state.get("format", 1) >= 2:
        return state
    g = state["config"]["train"]["global_batch_size"]
    return dict(
        state,
        format=FORMAT,
        rng=[state["rng"]],
        task={},
        step_in_epoch=state["samples_in_epoch"] // g,
        best=state.get("best_accuracy"),
    )


def restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    task: Any,
    seed: int,
    device: torch.device,
    rank: int,
    world_size: int,
) -> Position:
    """Load ``state`` into the run's objects on this rank and return the position to continue from."""
    state = upgrade(state)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return resume_rest(
        state,
        scheduler,
        task,
        seed,
        device,
        rank,
        world_size,
        what="a checkpoint",
        changed="same samples and order, fresh per-rank RNG streams (see docs/tasks.md, 'Resume')",
    )


def resume_rest(
    record: dict[str, Any],
    scheduler: Any,
    task: Any,
    seed: int,
    device: torch.device,
    rank: int,
    world_size: int,
    what: str,
    changed: str,
) -> Position:
    """What follows the model and optimizer, whole or sharded: the schedule, the task's own state,
    this rank's RNG streams (fresh ones at another world size, with one warning naming ``what`` and
    what ``changed``), and the position to continue from."""
    scheduler.load_state_dict(record["scheduler"])
    task.load_state_dict(record["task"])
    if len(record["rng"]) == world_size:
        set_rng_state(record["rng"][rank], device)
    else:
        seed_rank(seed, rank, record["step"], device)
        if rank == 0:
            log.warning(
                "resuming at world size %d from %s of world size %d: %s", world_size, what, len(record["rng"]), changed
            )
    return Position(
        step=record["step"],
        epoch=record["epoch"],
        step_in_epoch=record["step_in_epoch"],
        elapsed_s=record["elapsed_s"],
        best=record["best"],
        last_saved=record["step"],
    )
