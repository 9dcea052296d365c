"""Rank 0's progress: a bar per epoch on a terminal, a plain line every ``train.log_every_s`` in a batch
log (``logs.Progress``), with the last window's loss, rate and time left."""

from __future__ import annotations

from typing import Any

import torch

from ddp_slurm.train import logs
from ddp_slurm.train.hooks.base import Hook, Training


class ProgressDisplay(Hook):
    def __init__(self, run: Any) -> None:
        self.progress = logs.Progress(run.rank == 0, run.cfg.train.log_every_s)

    def epoch_start(self, t: Training) -> None:
        run = t.run
        self.progress.start_epoch(run.pos.epoch, run.cfg.train.epochs, run.epoch_steps(), run.pos.step_in_epoch)

    def after_step(self, t: Training, loss: torch.Tensor) -> None:
        pos = t.run.pos
        self.progress.update(
            pos.step, pos.epoch, pos.step_in_epoch, t.run.epoch_steps(), t.loss, samples_per_s=t.rate, eta_s=t.eta()
        )

    def epoch_end(self, t: Training) -> None:
        self.progress.end_epoch()

    def end(self, t: Training) -> None:
        self.progress.end_epoch()
