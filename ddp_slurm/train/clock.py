"""This rank's compute time per step, to tell a slow node from a slow job (``hooks/slowranks.py``).

Under ddp every rank waits for the slowest at each gradient all-reduce, so a step takes as long on every rank;
the task's forward (its ``training_step`` up to the loss) waits for nobody, and takes longer only on a rank
whose node computes slower. The clock times it: host time on CPU (the forward is synchronous there), CUDA
events on a GPU, read at the next log window (long finished by then: no added sync). Under fsdp the forward
holds the parameters' all-gathers, so the figure includes waiting there too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class ComputeClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    def wrap(self, loss_of: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        """``loss_of`` timed."""

        def timed(model: Any, batch: Any) -> torch.Tensor:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = loss_of(model, batch)
                end.record()
                self._events.append((start, end))
                return loss
            began = time.perf_counter()
            loss = loss_of(model, batch)
            self.seconds += time.perf_counter() - began
            return loss

        return timed

    def take(self) -> float:
        """Seconds of forward since the last ``take`` (at a log window: the device has passed the events)."""
        if self._events:
            self.seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
            self._events.clear()
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def ratio_to_others(times: list[float], rank: int) -> float:
    """``rank``'s time over the median of the other ranks' (inf when theirs is 0)."""
    others = _median(times[:rank] + times[rank + 1 :])
    return times[rank] / others if others > 0 else float("inf")


def slow_ranks(times: list[float], factor: float) -> list[int]:
    """The ranks whose time exceeds ``factor`` times the median of the other ranks' (so that with two ranks
    the slow one is judged against the other, not against a median it pulls up)."""
    if len(times) < 2:
        return []
    return [r for r in range(len(times)) if factor < ratio_to_others(times, r) < float("inf")]
