"""The training step and the exact distributed evaluation, shared by the loop and the benchmarks.

The step is written for speed on small models, where framework overhead rivals the math: gradients
are dropped (``set_to_none``) instead of zeroed, the optimizer uses the fused kernel (``optim.py``), one
process trains without the DDP wrapper (``ddp.py``: nothing to all-reduce), and nothing in the step
waits for the device (the loss stays a tensor; the caller syncs when it logs; the stop vote is
``vote.py``). ``python -m ddp_slurm.bench`` measures it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_slurm.distributed.groups import Groups
from ddp_slurm.train.loader import batch_size_of

NO_GROUPS = Groups()
_END = (
    object()
)  # the end of a rank's evaluation batches  # one process, or torch's default group for everything (tests)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision in ("bf16", "fp16"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    return contextlib.nullcontext()


def make_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
    precision: str = "fp32",
    *,
    accumulate: int = 1,
    grad_clip: float | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> Callable[[Any], torch.Tensor]:
    """Return ``step(batch) -> loss``: the task's loss (``loss_of(model, batch)``), backward, optimizer and
    schedule steps. Nothing in it waits for the device: the loss comes back as a tensor.

    ``accumulate`` micro-batches per optimizer step, clipping to ``grad_clip`` and fp16's gradient
    ``scaler`` are ``accumulate.py``'s step (whose ``grad_norm`` holds the norm before clipping); without
    any of them, the plain step below."""
    cast = autocast(device, precision)
    if accumulate > 1 or grad_clip is not None or scaler is not None:
        from ddp_slurm.train.accumulate import AccumulatingStep

        return AccumulatingStep(
            model, optimizer, scheduler, loss_of, cast, accumulate=accumulate, grad_clip=grad_clip, scaler=scaler
        )

    def step(batch: Any) -> torch.Tensor:
        with cast:
            loss = loss_of(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.detach()

    return step


class Padding:
    """An evaluation batch that runs through the model but counts for nothing (``fsdp.padded``: every
    forward of a sharded model is a collective, so every rank runs as many as the rank with the most)."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Any],
    metrics_of: Callable[[nn.Module, Any], dict[str, torch.Tensor]],
    device: torch.device,
    world_size: int,
    precision: str = "fp32",
    *,
    groups: Groups = NO_GROUPS,
    vote: Callable[[bool], bool | None] | None = None,
) -> tuple[dict[str, float], int] | None:
    """Exact distributed evaluation: per-sample metric sums over this rank's shard, added over ranks,
    divided by the number of samples (every sample counted once whatever the world size).

    ``model`` must be the bare module, not the DDP wrapper (ranks hold shards of unequal size). Every
    rank first takes rank 0's buffers: batch-norm statistics drift apart between ranks during training
    (see ``wrap_ddp``), and the model evaluated must be the one rank 0 checkpoints. Returns
    (metrics, samples). ``groups``: the run's (device tensors on ``train``, the names on ``host``).

    ``vote(has_batch)``, asked before each batch on every rank (``evaluation.EvalVote``): True goes on,
    False ends the evaluation (no rank has a batch left), None abandons it (a stop signal): None returned.
    """
    take_rank0_buffers(model, world_size, groups.train)
    was_training = model.training
    model.eval()
    names: list[str] | None = None
    totals = torch.zeros(1, dtype=torch.float64, device=device)  # [samples, metric sums ...]
    batches = iter(batches)
    with autocast(device, precision):
        while True:
            batch = next(batches, _END)
            if vote is not None:
                verdict = vote(batch is not _END)
                if verdict is None:
                    model.train(was_training)
                    return None
                if not verdict:
                    break
            if batch is _END:
                if vote is None:
                    break
                continue  # this rank's shard is done; the others' are not: it keeps voting
            if isinstance(batch, Padding):
                metrics_of(model, batch.batch)
                continue
            sums = metrics_of(model, batch)
            if names is None:
                names = sorted(sums)
                totals = torch.zeros(1 + len(names), dtype=torch.float64, device=device)
            totals[0] += batch_size_of(batch)
            for i, name in enumerate(names, 1):
                totals[i] += sums[name].detach().double().sum()
    if world_size > 1:
        layout: list[Any] = [names]
        dist.broadcast_object_list(layout, src=0, group=groups.host)  # a rank with no samples learns the names
        if names is None:
            names = layout[0] or []
            totals = torch.zeros(1 + len(names), dtype=torch.float64, device=device)
        dist.all_reduce(totals, group=groups.train)
    names = names or []
    model.train(was_training)
    values = totals.tolist()
    count = int(values[0])
    return {name: v / max(count, 1) for name, v in zip(names, values[1:])}, count


def take_rank0_buffers(model: nn.Module, world_size: int, group: Any) -> None:
    """Every rank's buffers (batch-norm statistics) become rank 0's, through ``group`` (the training group).

    Each rank's running statistics evolve on its own batches; rank 0's are the model's, whatever the
    strategy: every rank takes them before an evaluation, and before a sharded save (``Sharded.capture``),
    so that the one copy a checkpoint keeps is rank 0's and a resumed run's ranks start where the run left
    alone stands (under ddp rank 0 writes the whole file itself).

    One broadcast per dtype (and device), of the buffers laid end to end: a collective per buffer would be
    about 60 for resnet18's batch norms, each a round trip of its own."""
    if world_size == 1:
        return
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in model.buffers():
        kinds.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    for same in kinds.values():
        flat = torch.cat([buffer.detach().reshape(-1) for buffer in same])
        dist.broadcast(flat, src=0, group=group)
        parts = flat.split([buffer.numel() for buffer in same])
        with torch.no_grad():  # one launch for the copies too
            torch._foreach_copy_(same, [part.view_as(buffer) for buffer, part in zip(same, parts)])


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite, read with one host sync whatever their number
    (``all(t.isfinite().all() for t in ...)`` waits for the device once per tensor)."""
    flags = [torch.isfinite(t).all() for t in tensors]
    return not flags or bool(torch.stack(flags).all().item())
