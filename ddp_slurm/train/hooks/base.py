"""The hook protocol (see ``hooks/__init__.py``): what a hook sees of the loop (``Training``), the points it
is called at (``Hook``), and the registered list the loop calls (``Hooks``)."""

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

    def parts(self) -> list[Any]:
        """The checkpoint parts of this feature's state (``checkpoint/parts.py``: ``Stateful(key, self)`` for an
        object with ``state_dict`` / ``load_state_dict``): saved with every checkpoint and put back before
        ``start``, so that a stop and a relaunch, or a rollback, leave the feature where it was."""
        return []


POINTS = ("start", "epoch_start", "before_step", "stepped", "boundary", "after_step", "epoch_end", "end")


class Hooks:
    """The registered hooks, called in order. Each point calls only the hooks that define it, through a
    list made once (``add`` remakes it): a step's five calls cost next to nothing when few hooks listen."""

    def __init__(self, hooks: Iterable[Hook]) -> None:
        self.hooks: list[Hook] = []
        self._at: dict[str, list[Any]] = {}
        for hook in hooks:
            self.add(hook)

    def add(self, hook: Hook) -> None:
        """Register ``hook`` after the others."""
        self.hooks.append(hook)
        self._at = {
            point: [getattr(h, point) for h in self.hooks if getattr(type(h), point) is not getattr(Hook, point)]
            for point in (*POINTS, "wants_host")
        }

    def start(self, t: Training) -> None:
        for call in self._at["start"]:
            call(t)

    def epoch_start(self, t: Training) -> None:
        for call in self._at["epoch_start"]:
            call(t)

    def before_step(self, t: Training) -> None:
        for call in self._at["before_step"]:
            call(t)

    def stepped(self, t: Training) -> None:
        for call in self._at["stepped"]:
            call(t)

    def wants_host(self, step: int) -> bool:
        return any(call(step) for call in self._at["wants_host"])

    def boundary(self, t: Training) -> None:
        for call in self._at["boundary"]:
            call(t)

    def after_step(self, t: Training, loss: torch.Tensor) -> None:
        for call in self._at["after_step"]:
            call(t, loss)

    def epoch_end(self, t: Training) -> None:
        for call in self._at["epoch_end"]:
            call(t)

    def end(self, t: Training) -> None:
        for call in self._at["end"]:
            call(t)
