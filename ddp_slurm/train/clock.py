"""This rank's compute time per step, to tell a slow node from a slow job (``hooks/slowranks.py``).

Under ddp every rank waits for the slowest at each gradient all-reduce, so a step takes as long on every rank;
the task's forward (its ``training_step`` up to the loss) waits for nobody, and takes longer only on a rank
whose node computes slower. The clock times it: host time on CPU (the forward is synchronous there), CUDA
events on a GPU. Under fsdp the forward holds the parameters' all-gathers, so the figure includes waiting
there too. At world size 1 there is no other rank to compare with: no clock, nothing added to the step
(``for_run``).

The events are bounded and read safely: a pair is read only once its end event has completed (``query``,
which does not wait), at most ``LIMIT`` pairs are held (beyond that the oldest are read as the device passes
them), and ``take`` (at a log window, where the loop allows the host to wait) synchronizes each end event
before its ``elapsed_time``, whichever hook ran before it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

LIMIT = 64  # pairs of CUDA events held between reads: the device is never that many steps behind the host


def for_run(
    loss_of: Callable[[Any, Any], torch.Tensor], device: torch.device, world_size: int
) -> tuple[ComputeClock | None, Callable[[Any, Any], torch.Tensor]]:
    """The run's clock and its loss function timed; at world size 1 none and ``loss_of`` itself."""
    if world_size < 2:
        return None, loss_of
    clock = ComputeClock(device)
    return clock, clock.wrap(loss_of)


class ComputeClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: deque[tuple[Any, Any]] = deque()

    def wrap(self, loss_of: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        """``loss_of`` timed."""

        def timed(model: Any, batch: Any) -> torch.Tensor:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = loss_of(model, batch)
                end.record()
                self._events.append((start, end))
                if len(self._events) >= LIMIT:
                    self._read(wait=False)
                    if len(self._events) >= LIMIT:  # the device LIMIT steps behind: wait for the oldest
                        self._read_oldest(wait=True)
                return loss
            began = time.perf_counter()
            loss = loss_of(model, batch)
            self.seconds += time.perf_counter() - began
            return loss

        return timed

    def _read(self, wait: bool) -> None:
        """Fold the pairs the device has passed (every pair with ``wait``) into ``seconds``, oldest first."""
        while self._events and (wait or self._events[0][1].query()):
            self._read_oldest(wait)

    def _read_oldest(self, wait: bool) -> None:
        """The oldest pair read; ``wait``: for its end first (else it has completed: ``query``). The start
        was recorded before the end on the same stream, so it has completed too."""
        start, end = self._events.popleft()
        if wait:
            end.synchronize()  # elapsed_time of an unfinished event raises
        self.seconds += start.elapsed_time(end) / 1000.0

    def reset(self) -> None:
        """Count from here: what was timed before is dropped, unread (no wait for the device)."""
        self._events.clear()
        self.seconds = 0.0

    def take(self) -> float:
        """Seconds of forward since the last ``take`` (at a log window: the host may wait there)."""
        self._read(wait=True)
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
