"""What ``bench overhead`` runs and its op count counts: the bundled sample repeated into one long epoch, as a
task for ``ddp_slurm.run`` and as the bare PyTorch loop it is compared with (the same data, model, optimizer,
schedule and batch). Apart from ``overhead.py`` so that ``opcount.py``'s workers import it without the bench."""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.nn.functional as F

from ddp_slurm.tasks.mnist import MNIST, data, models
from ddp_slurm.train.task import Tensors

LOG_EVERY = 20  # train.log_every_steps's default: the ddp_slurm rate is read from these rows


def repeats(steps: int, batch: int) -> int:
    """How often the sample is repeated so that one epoch holds warm-up and measured steps."""
    return math.ceil((steps + LOG_EVERY) * batch / data.TRAIN_SIZES["sample"]) + 1


class LongSample(MNIST):
    """The MNIST task on the bundled sample repeated ``DDP_SLURM_BENCH_REPEATS`` times, no evaluation."""

    def train_data(self) -> Tensors:
        images, labels = super().train_data().tensors
        times = int(os.environ.get("DDP_SLURM_BENCH_REPEATS", "1"))
        return Tensors(images.repeat(times, 1, 1), labels.repeat(times))

    def eval_data(self) -> None:
        return None


def bare_loop(
    model_name: str,
    batch: int,
    steps: int,
    repeats: int,
    device: torch.device,
    measured: contextlib.AbstractContextManager | None = None,
) -> float:
    """samples/s of a plain PyTorch loop on the same data, model, optimizer, schedule and batch;
    ``measured``: a context around the measured steps only (``opcount.OpCounter``)."""
    train = data.load_sample(train=True)
    images = train.images.repeat(repeats, 1, 1).to(device)
    labels = train.labels.repeat(repeats).to(device)
    torch.manual_seed(0)
    model = models.build(model_name).to(device)
    lr, total = 4e-3, steps + LOG_EVERY
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=total, pct_start=0.25, cycle_momentum=False
    )
    order = torch.randperm(len(labels), device=device)

    def train_steps(first: int, count: int) -> torch.Tensor:
        for i in range(first, first + count):
            index = order[i * batch : (i + 1) * batch]
            loss = F.cross_entropy(model(data.normalize(images[index])), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        return loss

    train_steps(0, LOG_EVERY).item()  # warm-up, as the ddp_slurm rate leaves its first window out
    start = time.perf_counter()
    with measured or contextlib.nullcontext():
        loss = train_steps(LOG_EVERY, steps)
    loss.item()
    return steps * batch / (time.perf_counter() - start)
