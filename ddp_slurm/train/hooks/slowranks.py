"""Slow nodes named: at every ``train`` line each rank's forward time over the window (``clock.py``) is shared,
and a rank slower than ``slurm.slow_factor`` times the other ranks' median in ``slurm.slow_windows`` windows
in a row is named with its host: one warning, a ``slow`` line in metrics.jsonl, and its host in
``<run dir>/slow_nodes`` (``slurm.exclude_slow`` leaves it out of the next start). A rank is named once per
launch. ``step_time_spread`` says how far apart the ranks are; this says who."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.slurmjob import badnodes
from ddp_slurm.train.clock import ratio_to_others, slow_ranks
from ddp_slurm.train.hooks.base import Hook, Training

log = logging.getLogger("ddp_slurm")


class SlowRanks(Hook):
    def __init__(self, run: Any) -> None:
        self.every = run.cfg.train.log_every_steps
        self.on = run.world_size > 1 and run.clock is not None
        self.streak = [0] * run.world_size
        self.named: set[int] = set()
        self.hosts: list[str] = []
        self.first = run.pos.step

    def start(self, t: Training) -> None:
        run = t.run
        self.first = run.pos.step
        if self.on and not self.hosts:
            self.hosts = [""] * run.world_size
            dist.all_gather_object(self.hosts, badnodes.host_name(), group=run.groups.host)
        if run.clock is not None:
            run.clock.reset()  # from here (after a rollback too: no wait for the device)

    def wants_host(self, step: int) -> bool:
        return self.on and step % self.every == 0

    def after_step(self, t: Training, loss: torch.Tensor) -> None:
        run = t.run
        if not self.on or run.pos.step % self.every:
            return
        steps = max(run.pos.step - self.first, 1)
        self.first = run.pos.step
        times = torch.zeros(run.world_size, dtype=torch.float64)
        times[run.rank] = run.clock.take() / steps
        dist.all_reduce(times, group=run.groups.host)  # every rank its own slot: the sum is the list
        values = times.tolist()
        slow = set(slow_ranks(values, run.cfg.slurm.slow_factor))
        self.streak = [s + 1 if r in slow else 0 for r, s in enumerate(self.streak)]
        for r in [r for r, s in enumerate(self.streak) if s >= run.cfg.slurm.slow_windows and r not in self.named]:
            self.named.add(r)
            self._name(t, r, ratio_to_others(values, r))

    def _name(self, t: Training, rank: int, ratio: float) -> None:
        run, host = t.run, self.hosts[rank]
        windows = run.cfg.slurm.slow_windows
        t.metrics.write("slow", run.pos.step, run.pos.epoch, t.elapsed(), rank=rank, host=host, ratio=round(ratio, 2))
        if run.rank != 0:
            return
        log.warning(
            "rank %d (host %s) is slow: its compute per step took %.1fx the other ranks' median in %d log windows "
            "in a row; recorded in %s%s",
            rank,
            host,
            ratio,
            windows,
            run.cfg.paths.slow_nodes,
            " (left out of the next start: slurm.exclude_slow)" if run.cfg.slurm.exclude_slow else "",
        )
        why = f"slow: compute per step {ratio:.1f}x the other ranks' median in {windows} log windows"
        try:
            badnodes.record(
                run.cfg.run_dir, [host], run.env.job_id, run.env.restart_count, why, 0, run.cfg.run.shared, slow=True
            )
        except OSError as exc:  # the run goes on; the warning above named the node
            log.warning("could not record slow node %s: %s", host, exc)
