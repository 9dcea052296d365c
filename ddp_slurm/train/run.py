"""The run's objects as one value: what the loop trains, the checkpointer saves and restores, and the
side features (``hooks/``) read.

``build`` makes them in the order the math needs, on every rank, before the run directory is taken:
the data and its batches (the schedule's length depends on them), the model (after the same seed on
every rank), the strategy's wrapper (DDP, or FSDP2 sharding in place), then the optimizer (on the
sharded parameters) and the schedule, and the step that ties them together. A model the strategy
cannot wrap fails here, with nothing created on disk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_slurm.config import Config, accumulation
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.distributed.groups import Groups
from ddp_slurm.train import graphs, loader, step
from ddp_slurm.train.checkpoint.parts import Part, Parts
from ddp_slurm.train.checkpoint.standard import standard
from ddp_slurm.train.checkpoint.state import Position
from ddp_slurm.train.clock import ComputeClock, for_run
from ddp_slurm.train.optim import make_optimizer, make_scheduler
from ddp_slurm.train.precision import make_scaler
from ddp_slurm.train.strategy import Strategy
from ddp_slurm.train.task import Context, Task, Tensors


@dataclass
class Run:
    """One rank's training run: its config and place, the task, the model and what trains it, where it stands."""

    cfg: Config
    env: DistEnv
    device: torch.device
    task: Task
    strategy: Strategy
    model: nn.Module
    """The model itself (sharded in place under fsdp): its state dict is what a checkpoint holds."""
    module: nn.Module
    """What the step calls: the DDP wrapper, or the model."""
    optimizer: Any
    scheduler: Any
    train_step: Callable[[Any], torch.Tensor]
    batches: Any
    """The training batches by (epoch, step): ``loader.InMemory`` or ``loader.DatasetBatches``."""
    eval_data: Any
    total_steps: int
    groups: Groups
    """The process groups its collectives name: device tensors on ``train``, host ones on ``host``."""
    pos: Position = field(default_factory=Position)
    scaler: Any = None
    """``train.precision=fp16``: the gradient scaler the step uses (its state is checkpointed); None otherwise."""
    parts: Parts | None = None
    """What a checkpoint holds beside the model and optimizer (``checkpoint/parts.py``): the standard parts, and
    those a batch source, a hook or the task registers."""
    clock: ComputeClock | None = None
    """This rank's forward time (``clock.py``: slow nodes); None under ``train.cuda_graphs`` (one capture) and at
    world size 1 (no other rank to compare with)."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def seed(self) -> int:
        return self.cfg.run.seed

    @property
    def steps_per_epoch(self) -> int:
        return self.batches.steps_per_epoch

    def close(self) -> None:
        """Stop what the run started besides this process (DataLoader worker processes)."""
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()

    def epoch_steps(self) -> int:
        """This epoch's steps (``train.max_steps`` may end it early)."""
        pos = self.pos
        return min(self.steps_per_epoch, pos.step_in_epoch + self.total_steps - pos.step)


def make_task(cfg: Config, task_cls: type[Task], env: DistEnv, device: torch.device) -> Task:
    """The task for this rank (``cfg.run.name`` may still be unset: the entry point checks the task's
    config before the ranks meet and the run is named)."""
    run_dir = Path(cfg.run.output_root) / (cfg.run.name or "")
    ctx = Context(env.rank, env.world_size, env.local_rank, device, cfg.run.seed, run_dir, cfg.train.global_batch_size)
    return task_cls(cfg.task_config, ctx)


def build(cfg: Config, task: Task, env: DistEnv, device: torch.device, strategy: Strategy, groups: Groups) -> Run:
    """Every rank: the run's objects, at step 0 (a checkpoint is restored into them afterwards)."""
    tc = cfg.train
    batches = loader.make_batches(
        task.train_data(), device, cfg.run.seed, tc.global_batch_size, env.rank, env.world_size, cfg=tc
    )
    eval_data = task.eval_data()
    if isinstance(eval_data, Tensors):
        eval_data = eval_data.to(device)  # in memory: moved once, like the training tensors
    total_steps = tc.epochs * batches.steps_per_epoch
    total_steps = min(total_steps, tc.max_steps) if tc.max_steps is not None else total_steps

    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = task.build_model().to(device)
    module = strategy.wrap(
        model,
        task,
        device,
        tc.precision,
        env.world_size,
        activation_checkpoint=tc.activation_checkpoint,
        group=groups.train,
    )
    optimizer = task.configure_optimizer(model) or make_optimizer(tc, model.parameters(), device)
    scheduler = task.configure_scheduler(optimizer, total_steps) or make_scheduler(tc, optimizer, total_steps)
    scaler = make_scaler(tc.precision, device, optimizer)  # fp16: refused if its step would sync (sync-debug)
    clock = None
    if tc.cuda_graphs:  # train.cuda_graphs: the whole step captured once and replayed (graphs.py)
        train_step = graphs.make_step(module, optimizer, scheduler, task.training_step, device, tc.precision)
    else:
        clock, loss_of = for_run(task.training_step, device, env.world_size)  # none at world size 1
        train_step = step.make_step(
            module,
            optimizer,
            scheduler,
            loss_of,
            device,
            tc.precision,
            accumulate=accumulation(cfg, env.world_size),
            grad_clip=tc.grad_clip,
            scaler=scaler,
        )
    run = Run(
        cfg,
        env,
        device,
        task,
        strategy,
        model,
        module,
        optimizer,
        scheduler,
        train_step,
        batches,
        eval_data,
        total_steps,
        groups,
        scaler=scaler,
        clock=clock,
    )
    run.parts = standard(run)
    for part in contributed(batches):  # a batch source with a cursor, say
        run.parts.add(part)
    return run


def contributed(owner: Any) -> list[Part]:
    """The checkpoint parts ``owner`` (a batch source, a hook, the task) registers: its ``parts()``, if any."""
    parts = getattr(owner, "parts", None)
    return list(parts()) if callable(parts) else []
