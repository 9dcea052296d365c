"""Which samples of a step the replay found bad: named by dataset index and left out of every later epoch.

A reproduced step is bad data, but a global batch holds many samples and usually one is to blame. Each rank
computes the task's loss on its share of the step's samples one at a time (``batches.samples``; the model in
eval mode, without gradients: no weight, buffer or RNG stream moves), the ranks share the figures, and every
rank picks the same culprits: the samples whose loss is not finite; else, for a spike, the fewest samples of
highest loss whose removal brings the step's mean loss back under the guard's limit (at most ``MOST`` of
them: a step that needs more is bad as a whole, and no sample is named). The loader then leaves the culprits
out of their global batch from that epoch on (``loader.dropped``), so one bad sample costs one rollback, not
one per epoch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.train.step import autocast

MOST = 8  # culprits named in one step at most


def find(run: Any, step: int, limit: float | None) -> list[int]:
    """Every rank (a collective on the host group): the dataset indices of ``step``'s culprits (the run's
    global step, counted from 1), the same list on every rank; ``limit``: the loss above which a step is a
    spike (None: only non-finite losses are looked for)."""
    per_epoch = run.steps_per_epoch
    epoch, in_epoch = divmod(step - 1, per_epoch)
    model, task = run.model, run.task
    training = model.training
    losses: list[tuple[int, torch.Tensor]] = []
    model.eval()
    try:
        with torch.no_grad(), autocast(run.device, run.cfg.train.precision):
            for index, batch in run.batches.samples(epoch, in_epoch):
                losses.append((index, task.training_step(model, batch).detach().float().reshape(())))
    finally:
        model.train(training)
    values = torch.stack([v for _, v in losses]).cpu().tolist() if losses else []  # one wait for the device
    mine = list(zip([i for i, _ in losses], values))
    everyone: list[Any] = [mine]
    if run.world_size > 1:
        everyone = [None] * run.world_size
        dist.all_gather_object(everyone, mine, group=run.groups.host)
    return choose([pair for share in everyone for pair in share], limit)


def choose(losses: list[tuple[int, float]], limit: float | None) -> list[int]:
    """The culprits among ``(index, loss)`` pairs (see the module docstring), sorted."""
    bad = sorted(i for i, v in losses if not math.isfinite(v))
    if bad:
        return bad[:MOST] if len(bad) <= MOST else []
    if limit is None or not losses:
        return []
    ranked = sorted(losses, key=lambda pair: pair[1], reverse=True)
    total, n = sum(v for _, v in losses), len(losses)
    if total / n <= limit:  # one at a time the step is no spike: no sample explains it
        return []
    for k in range(1, min(MOST, n - 1) + 1):
        total -= ranked[k - 1][1]
        if total / (n - k) <= limit:
            return sorted(i for i, _ in ranked[:k])
    return []
