"""Gradient accumulation and clipping: ``train.accumulate`` and ``train.grad_clip``.

One optimizer step takes the rank's whole share of the global batch (``global_batch_size / world_size``
samples, the loader's batch) and splits it into ``accumulate`` micro-batches along the first dimension.
Each micro-batch runs forward and backward with its loss divided by ``accumulate``, so the summed
gradient is the gradient of the mean loss over the rank's share, as with one batch.

How gradients cross ranks depends on the strategy, and the choice is made for memory:

- DDP: only after the last micro-batch (``no_sync`` around the others). Every rank holds the whole
  gradient anyway, so holding it unsynchronised costs nothing, and the all-reduce per optimizer step
  stays one.
- FSDP2: every micro-batch's backward reduce-scatters as usual, and FSDP adds each reduced shard into
  the sharded ``.grad`` (1/N of the gradient per rank), as torchtitan does. Skipping the sync
  (``set_requires_gradient_sync(False)``) would keep an *unsharded* accumulated gradient on every
  rank (4 bytes per parameter in fp32), which is the memory FSDP is chosen to save. The cost is one
  reduce-scatter per micro-batch; the all-gathers per micro-batch happen either way (units reshard
  after forward and backward).

The data order, the position and the stop vote count optimizer steps, so a stop always lands between
two of them and a resume is exact.

Clipping scales every gradient by ``min(1, grad_clip / norm)`` where ``norm`` is the L2 norm over all
gradients of the model (torch's ``clip_grad_norm_``, which reduces over the shards of FSDP's DTensors),
and records that norm for the ``grad_norm`` figure of the ``train`` lines.

``train.precision=fp16``: torch's ``GradScaler`` multiplies each micro-batch's loss by its scale before
backward, divides the gradients by it before clipping (``unscale_``), and steps the optimizer only when
every gradient is finite; a step with inf/NaN gradients (fp16 overflow, normal while the scale settles)
is skipped and the scale halved. The loss returned is the unscaled one: an overflow of the gradients is
not a non-finite loss, and the stop vote (``vote.py``) never sees it. The schedule steps either way, so
the position and the schedule count steps as without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def split(batch: Any, n: int) -> list[Any]:
    """``batch`` (a tensor, or a tuple/list/dict of them, nested) as ``n`` micro-batches of equal size."""
    if isinstance(batch, torch.Tensor):
        size = batch.shape[0]
        if size % n:
            raise ValueError(f"a batch of {size} samples does not split into train.accumulate={n} micro-batches")
        return list(batch.split(size // n))
    if isinstance(batch, (list, tuple)):
        parts = [split(b, n) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(n)]
    if isinstance(batch, dict):
        parts_by_key = {k: split(v, n) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts_by_key.items()} for i in range(n)]
    return [batch] * n  # a plain value (a flag, a string) rides along with every micro-batch


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context of a micro-batch's backward that is not the last: DDP's ``no_sync`` (gradients only
    accumulate locally); nothing for FSDP2 (each micro-batch reduce-scatters into the sharded ``.grad``,
    see the module's docstring) and for a bare model (one process: nothing to synchronise)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients to ``max_norm`` (global L2 norm); returns the norm before clipping, a plain
    0-d tensor on the device (the same on every rank). No host sync."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    full = getattr(norm, "full_tensor", None)  # FSDP: a DTensor, reduced over the shards
    return full() if full is not None else norm


class AccumulatingStep:
    """``step(batch) -> loss`` with accumulation and/or clipping; ``grad_norm`` after each call (clipping on)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loss_of: Callable[[nn.Module, Any], torch.Tensor],
        cast: contextlib.AbstractContextManager,
        *,
        accumulate: int,
        grad_clip: float | None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.loss_of, self.cast = model, optimizer, scheduler, loss_of, cast
        self.accumulate, self.grad_clip, self.scaler = accumulate, grad_clip, scaler
        self.grad_norm: torch.Tensor | None = None

    def __call__(self, batch: Any) -> torch.Tensor:
        n = self.accumulate
        micro = split(batch, n) if n > 1 else [batch]
        self.optimizer.zero_grad(set_to_none=True)
        total: torch.Tensor | None = None
        for i, part in enumerate(micro):
            with contextlib.nullcontext() if i == n - 1 else no_sync(self.model):
                with self.cast:
                    loss = self.loss_of(self.model, part)
                share = loss / n if n > 1 else loss
                (share if self.scaler is None else self.scaler.scale(share)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.grad_clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            self.grad_norm = clip(self.model, self.grad_clip)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)  # skipped where a gradient is not finite
            self.scaler.update()
        self.scheduler.step()
        assert total is not None
        return total / n if n > 1 else total


class NormWindow:
    """The gradient norm (before clipping) averaged over the steps of one ``train`` line; on the device."""

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.n = 0

    def add(self, norm: torch.Tensor | None) -> None:
        """Count ``norm`` if it is finite (no host sync): an fp16 step skipped for overflowing gradients has
        an inf norm and counts for nothing; under fp32 a non-finite norm comes with a non-finite loss,
        which stops the run (``vote.py``)."""
        if norm is not None:
            norm = norm.detach().float()
            finite = torch.isfinite(norm)
            pair = torch.stack([torch.where(finite, norm, torch.zeros_like(norm)), finite.float()])
            self.sum = pair if self.sum is None else self.sum + pair
            self.n += 1

    def state_dict(self) -> dict[str, Any]:
        return {"sum": None if self.sum is None else self.sum.cpu(), "n": self.n}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.sum = None if state["sum"] is None else state["sum"].to(device)
        self.n = state["n"]

    def close(self) -> dict[str, float]:
        """``{"grad_norm": mean}`` over the window's finite norms (empty without clipping, or if none was
        finite); starts the next window."""
        if self.sum is None:
            return {}
        total, count = self.sum.tolist()
        self.sum, self.n = None, 0
        return {"grad_norm": total / count} if count else {}
