"""The watchdog hears of every step (``distributed/watchdog.py``): a rank that stops stepping is named by
the others before the backend's own timeout ends the job."""

from __future__ import annotations

from typing import Any

from ddp_slurm.train.hooks.base import Hook, Training


class Heartbeat(Hook):
    def __init__(self, dog: Any) -> None:
        self.dog = dog  # None: one process, or no watchdog

    def stepped(self, t: Training) -> None:
        if self.dog is not None:
            self.dog.progress(t.run.pos.step)
