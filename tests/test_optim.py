"""The runtime's learning-rate schedule: every run length steps through it (train/optim.py)."""

from __future__ import annotations

import math

import pytest
import torch

from ddp_slurm import config
from ddp_slurm.train.optim import make_optimizer, make_scheduler


@pytest.mark.parametrize("total", range(1, 41))
def test_the_default_schedule_takes_every_run_length(total: int) -> None:
    """``train.max_steps=4`` once died in OneCycleLR (a one-step warm-up is a division by zero in torch)."""
    cfg = config.Config().train
    model = torch.nn.Linear(2, 2)
    optimizer = make_optimizer(cfg, model.parameters(), torch.device("cpu"))
    scheduler = make_scheduler(cfg, optimizer, total)
    rates = []
    for _ in range(total):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert all(math.isfinite(r) and r >= 0 for r in rates)
    assert max(rates, default=cfg.lr) <= cfg.lr * (1 + 1e-9)
