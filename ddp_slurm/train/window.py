"""What rank 0 reports of the steps: the loss and rate over a log window (one host sync per window),
and where the ranks run (once per launch)."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.text import counted
from ddp_slurm.train import logs

log = logging.getLogger("ddp_slurm")


class LossWindow:
    """The training loss averaged over the steps between two log lines, and the rate over them.

    The loss stays on the device while it accumulates: reading it is the one host sync per window. The
    steps' losses are kept as they come (each step returns a tensor of its own: ``step.py`` detaches
    the task's loss, ``graphs.py`` clones its static output) and summed when the window closes, so a
    step adds no kernel (a running ``sum += loss`` was one launch per step: ``bench overhead`` counts them).
    """

    FOLD = 1024  # losses kept before they are summed into one (a long window holds no more than this)

    def __init__(self, device: torch.device, world_size: int, global_batch: int, step: int, group: Any) -> None:
        """``group``: the training group (the loss stays on the training device)."""
        self.device, self.n, self.world_size, self.global_batch = device, 0, world_size, global_batch
        self.losses: list[torch.Tensor] = []
        self.group = group
        self.started, self.first_step = time.monotonic(), step
        self.loss: float | None = None
        self.rate: float | None = None

    def add(self, loss: torch.Tensor) -> None:
        self.losses.append(loss)
        self.n += 1
        if len(self.losses) >= self.FOLD:
            self.losses = [self._sum()]

    def _sum(self) -> torch.Tensor:
        if not self.losses:
            return torch.zeros((), device=self.device)
        return torch.stack([t if t.dim() == 0 else t.reshape(()) for t in self.losses]).float().sum()

    def state_dict(self) -> dict[str, Any]:
        """The open window, for a checkpoint (a stop cuts it): its first step, its steps' losses (one copy to the
        host), how many steps it holds and its seconds so far. A run resumed from it logs the window's line over
        all its steps, the line the run left alone logs."""
        losses = torch.stack([t.reshape(()) for t in self.losses]).cpu() if self.losses else torch.zeros(0)
        return {
            "first_step": self.first_step,
            "n": self.n,
            "losses": losses,
            "seconds": time.monotonic() - self.started,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = list(state["losses"].to(self.device).unbind())
        self.n, self.first_step = state["n"], state["first_step"]
        self.started = time.monotonic() - state["seconds"]

    def close(self, step: int) -> dict[str, float]:
        """The window's figures for metrics.jsonl: loss (mean over steps and ranks), samples/s, mean step
        time, and how far apart the ranks' step times were ((slowest - fastest) / mean); starts the next
        window."""
        now = time.monotonic()
        steps = max(step - self.first_step, 1)
        mean = self._sum() / max(self.n, 1)
        own = (now - self.started) / steps
        if self.world_size > 1:
            dist.all_reduce(mean, group=self.group)
            mean /= self.world_size
            times = torch.full((2,), own, dtype=torch.float64, device=mean.device)  # made there: no copy
            times[1:].neg_()
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.group)  # slowest and (negated) fastest rank
            loss, slowest, fastest = torch.cat([mean.double().reshape(1), times]).tolist()  # the one sync
            fastest = -fastest
        else:
            loss, slowest, fastest = mean.item(), own, own  # the one sync
        self.loss, self.rate = loss, steps * self.global_batch / (now - self.started)
        self.losses = []
        self.n, self.started, self.first_step = 0, now, step
        return {
            "loss": self.loss,
            "samples_per_s": self.rate,
            "step_time_s": (slowest + fastest) / 2,
            "step_time_spread": (slowest - fastest) / max((slowest + fastest) / 2, 1e-12),
        }


def log_placement(env: DistEnv, group: Any) -> list[str]:
    """Rank 0 logs once which host each rank runs on: the first thing to check when a job misbehaves.
    Returns every rank's host, in rank order (gathered through ``group``, the host group)."""
    host = socket.gethostname()
    hosts = [host] * env.world_size
    if env.world_size > 1:
        dist.all_gather_object(hosts, host, group=group)
    if env.rank == 0:
        shape = f"{counted(env.world_size, 'rank')}, {counted(len(set(hosts)), 'host')}"
        log.info("ranks by host (%s): %s", shape, logs.rank_map(hosts))
    return hosts
