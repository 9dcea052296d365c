"""DistributedDataParallel as the runtime uses it: the wrapper (none for one process), bucket sizes for
small models, and the warm-up that fixes DDP's bucket layout before the first real step (exact resume).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def wrap_ddp(
    model: nn.Module,
    device: torch.device,
    world_size: int,
    settle: bool = False,
    group: Any = None,
) -> nn.Module:
    """The module the training step calls: DDP across ranks (over ``group``, the training group; None:
    the default group), the bare model for one process.

    One process has nothing to all-reduce, and DDP would still copy every gradient into its bucket
    and run its hooks each step; the math is the same either way (averaging over one rank is the
    identity). ``gradient_as_bucket_view`` lets the gradients live in DDP's buckets (no copy), and a
    small model gets two buckets instead of one (``bucket_cap_mb``).

    Buffers (batch-norm statistics) are not broadcast at every forward, as DDP does by default: that
    broadcast is a second point per step where every rank waits for the slowest, and it changes
    nothing that matters. Training-mode batch norm normalises with the batch's own statistics; the
    running ones are only read by evaluation, which first takes rank 0's (``evaluate``), and rank 0's
    evolve exactly as with the broadcast (it is the source), so checkpoints are bit-for-bit the same.
    """
    if world_size == 1:
        return model
    fields = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    no_buffer_sync = (
        {"forward_sync_buffers": False} if "forward_sync_buffers" in fields else {"broadcast_buffers": False}
    )
    cap = bucket_cap_mb(model)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        process_group=group,
        **no_buffer_sync,
        **({"bucket_cap_mb": cap} if cap is not None else {}),
    )
    if settle:
        settle_buckets(ddp, model)
    return ddp


DDP_FIRST_BUCKET_BYTES = 1024**2  # DDP's default size of its first bucket (the others: 25 MiB)


def bucket_cap_mb(model: nn.Module) -> float | None:
    """DDP's bucket size for ``model``: None (DDP's defaults) unless all its gradients fit in DDP's first
    bucket, then half of them.

    DDP all-reduces a bucket as soon as all its gradients exist, while backward goes on through the
    earlier layers; one bucket holding every gradient (what DDP's defaults make of a model under 1 MiB,
    such as both example models) starts its all-reduce only once backward has finished. Two halves let
    the last layers' gradients travel while the first layers' backward runs (cnn on 2 CPU ranks: about
    2% more samples/s). Larger models already get several buckets from DDP.
    """
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if grad_bytes == 0 or grad_bytes > DDP_FIRST_BUCKET_BYTES:
        return None
    return grad_bytes / 2 / 2**20


def settle_buckets(ddp: nn.Module, model: nn.Module) -> None:
    """One throwaway backward, so that every real step reduces gradients in DDP's final bucket layout.

    DDP sums gradients in the layout of its buckets and rebuilds that layout after the first backward
    (in the order the gradients became ready). With three or more ranks the layout decides in which
    order the ranks' float gradients are added, so the first step of each launch would round
    differently from the same step of an uninterrupted run, and a resumed run would not end
    bit-identical. The throwaway backward runs no task code: a task's ``training_step`` is called for
    real steps only, exactly once each, so a task that counts its steps or keeps an average (a
    curriculum, an EMA) ends a resumed run in the state an uninterrupted one has. Its loss is every
    trainable parameter times zero, summed in registration order (ready in reverse order, as DDP lays
    its buckets out before any backward): the same layout on every launch; no batch, no randomness,
    no change to weights, buffers or the optimizer; the zero gradients are dropped.
    """
    params = [p for p in model.parameters() if p.requires_grad]

    def zero_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.stack([(p * 0).sum().float() for p in params]).sum()

    model.forward = zero_loss  # what DDP's forward calls (self.module(...)): its hooks see a normal step
    try:
        ddp().backward()
    finally:
        del model.forward
        model.zero_grad(set_to_none=True)
