"""A task that poisons known samples, or one rank's loss once, for tests/test_guard.py and the cluster test.

``Poison`` fits a small classifier to random points whose third tensor is each sample's id. Samples named
by ``poison.ids`` multiply their rank's loss by 1e6: bad data, the same every time it is trained on.
``poison.fault_rank`` / ``poison.fault_call`` multiply that rank's loss at its N-th training step of the
process once only: a fault a replay does not reproduce. ``poison.record`` writes the sample ids each rank
trains on (``global_batches`` reads them back). ``poison.shards`` trains on the same points written as shards.
``poison.noise`` makes every backward nondeterministic.
``PoisonOnFakeGpu`` (``write_poison_task(..., fake_sync_debug=True)``) runs it in a process that stands in for
a GPU under DDP_SLURM_SYNC_DEBUG=error.
"""

from __future__ import annotations

from pathlib import Path

POISON_TASK = '''
import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ddp_slurm import Shards, Task, Tensors
from ddp_slurm.config import checked
from ddp_slurm.shards.decode import tensors


@dataclass
class PoisonSection:
    ids: str = ""
    """Comma-separated sample ids whose loss is multiplied by 1e6."""
    nan: bool = False
    """The loss of a batch holding one of ``ids`` is NaN instead (a NaN-producing sample)."""
    fault_rank: int = -1
    fault_call: int = 0
    size: int = 512
    sleep: float = 0.0
    signal_call: int = checked(0, resumable=True)
    """At its N-th training step, the process sends itself SIGUSR2 (a stop that lands on a known step), once:
    a file ``signalled`` in the working directory says it was sent."""
    """Seconds each training step sleeps (a run slow enough for a signal to land mid-run)."""
    record: bool = False
    """Each training micro-batch appends its sample ids, one line, to ``<run dir>/ids/<world size>-<rank>.txt``."""
    shards: str = ""
    """A folder of shards written from this task's points (``ddp-slurm data write task=...``): trained on
    instead of the in-memory points, each sample's id read back from its shard."""
    noise: float = 0.0
    """Every rank's gradients get noise of this scale from an unseeded generator, the loss unchanged to the
    bit: a nondeterministic backward (atomics, cuDNN's weight gradients on a GPU), in every pass."""


@dataclass
class PoisonConfig:
    poison: PoisonSection = field(default_factory=PoisonSection)


class Poison(Task):
    Config = PoisonConfig
    best_metric = "loss"
    higher_is_better = False
    fired = False  # the one-shot fault: once per process, never in its replay

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.ids = torch.tensor([int(i) for i in config.poison.ids.split(",") if i.strip()], dtype=torch.long)
        self.calls = 0

    def points(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=g)
        y = (x[:, 0] + x[:, 1] > 0).long()
        return x, y, torch.arange(n)

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))

    def train_data(self):
        if self.config.poison.shards:
            return Shards(self.config.poison.shards, tensors)
        return Tensors(*self.points(self.config.poison.size, 0))

    def training_step(self, model, batch):
        if self.config.poison.sleep:
            time.sleep(self.config.poison.sleep)
        x, y, idx = batch
        loss = F.cross_entropy(model(x), y)
        if self.config.poison.record and model.training:
            folder = self.ctx.run_dir / "ids"
            folder.mkdir(exist_ok=True)
            with open(folder / f"{self.ctx.world_size}-{self.ctx.rank}.txt", "a") as f:
                f.write(" ".join(str(i) for i in idx.tolist()) + "\\n")
        if len(self.ids):
            if self.ids.device != idx.device:  # on a GPU: once, at the first step (before the sync-debug watch)
                self.ids = self.ids.to(idx.device)
            bad = float("nan") if self.config.poison.nan else 1e6
            loss = loss * torch.where(torch.isin(idx, self.ids).any(), bad, 1.0)
        if not model.training:  # the guard trying samples one at a time (eval mode): no training step
            return loss
        self.calls += 1
        p = self.config.poison
        if p.noise:
            if not hasattr(self, "entropy"):  # unseeded: a replay never draws the same noise
                self.entropy = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))
            w = next(model.parameters())
            kick = (w * torch.randn(w.shape, generator=self.entropy).to(w.device) * p.noise).sum()
            loss = loss + (kick - kick.detach())  # + 0.0 exactly: only the gradients differ
        if self.calls == p.signal_call and not os.path.exists("signalled"):  # once per run directory's cwd
            open("signalled", "w").close()
            os.kill(os.getpid(), signal.SIGUSR2)
        if self.ctx.rank == p.fault_rank and self.calls == p.fault_call and not Poison.fired:
            Poison.fired = True
            loss = loss * 1e6
        return loss

    def eval_data(self):
        return Tensors(*self.points(128, 1))

    def eval_step(self, model, batch):
        x, y, _ = batch
        return {"loss": F.cross_entropy(model(x), y, reduction="none")}
'''

FAKE_SYNC_DEBUG = '''

from ddp_slurm.train import window
from ddp_slurm.train.checkpoint import checkpointer
from ddp_slurm.train.guard import replay
from ddp_slurm.train.hooks import syncdebug


class PoisonOnFakeGpu(Poison):
    """``Poison`` in a process that stands in for a GPU under DDP_SLURM_SYNC_DEBUG (there is none here nor in
    CI): torch.cuda's sync debug mode is held in this process, the watch is on although the device is the
    CPU, and while the mode is "error" the calls that wait for the device on a GPU raise torch's error: the
    guard's rollback (a checkpoint loaded into the device's tensors), its verdict (the traces read) and a
    log line's read of the loss window (steady steps call none of them)."""

    installed = False  # the process may make the task more than once: the stand-in goes in once

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        if not PoisonOnFakeGpu.installed:
            PoisonOnFakeGpu.installed = True
            self.install()

    @staticmethod
    def install():
        mode = [0]
        names = {"default": 0, "warn": 1, "error": 2}
        torch.cuda.set_sync_debug_mode = lambda m: mode.__setitem__(0, names.get(m, m))
        torch.cuda.get_sync_debug_mode = lambda: mode[0]
        syncdebug.SyncWatch.from_environ = classmethod(
            lambda cls, environ, device, first: cls(syncdebug.mode_from(environ), first)
        )

        def syncing(call):
            def guarded(*args, **kwargs):
                if mode[0] == 2:
                    raise RuntimeError(f"called a synchronizing CUDA operation ({call.__qualname__})")
                return call(*args, **kwargs)

            return guarded

        checkpointer.Checkpointer.go_back = syncing(checkpointer.Checkpointer.go_back)
        replay.Trace.values = syncing(replay.Trace.values)
        window.LossWindow.close = syncing(window.LossWindow.close)
'''

GUARDED = [
    "task=poison_task.py:Poison",
    "train.epochs=2",
    "train.global_batch_size=32",
    "train.lr=0.01",
    "train.log_every_steps=4",
    "checkpoint.every_steps=5",
    "guard.rollbacks=2",
    "guard.warmup=5",
    "guard.window=10",
]
"""16 steps per epoch, 32 in all; a checkpoint every 5 steps; the guard on, judging spikes from step 6."""


def write_poison_task(folder: Path, fake_sync_debug: bool = False) -> Path:
    """``poison_task.py`` in ``folder``; with ``fake_sync_debug``, with ``PoisonOnFakeGpu`` too."""
    path = folder / "poison_task.py"
    path.write_text(POISON_TASK + (FAKE_SYNC_DEBUG if fake_sync_debug else ""))
    return path


def final_weights(run_dir: Path) -> dict:
    """The model state of the run's newest checkpoint, whichever backend wrote it."""
    from ddp_slurm.train.checkpoint import backends, gate

    path, record = gate.latest(run_dir)
    return backends.backend_at(path).load_whole(path, record)["model"]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = final_weights(a), final_weights(b)
    import torch

    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def global_batches(run_dir: Path, world: int, accumulate: int) -> list[list[int]]:
    """The sample ids of each optimizer step of a ``poison.record`` run at world size ``world`` (sorted), read
    from its ranks' files: a rank's ``accumulate`` micro-batches in a row make its share of one step. Raises
    when a rank's micro-batches differ in size from the first (the per-rank micro-batch was not kept)."""
    ranks = [
        [[int(i) for i in line.split()] for line in (run_dir / "ids" / f"{world}-{r}.txt").read_text().splitlines()]
        for r in range(world)
    ]
    sizes = {len(micro) for rank in ranks for micro in rank}
    assert len(sizes) == 1, f"micro-batches of {sorted(sizes)} samples at world size {world}"
    steps = len(ranks[0]) // accumulate
    return [
        sorted(i for rank in ranks for micro in rank[s * accumulate : (s + 1) * accumulate] for i in micro)
        for s in range(steps)
    ]
