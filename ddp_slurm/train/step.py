"""The pieces of training that the loop and the benchmarks share: optimizer, schedule, step, evaluation.

The step is written for speed on small models, where framework overhead rivals the math: gradients
are dropped (``set_to_none``) instead of zeroed, the optimizer uses the fused kernel (one pass over
each tensor; multi-tensor ``foreach`` where torch has no fused kernel for the device), one process
trains without the DDP wrapper (nothing to all-reduce), and nothing in the step waits for the device
(the loss stays a tensor; the caller syncs when it logs). ``python -m ddp_slurm.bench`` measures it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_slurm.config import TrainConfig
from ddp_slurm.train.loader import batch_size_of
from ddp_slurm.train.signals import StopFlag

_PLAIN_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


@functools.cache
def eager(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` without its torch.compile guards: the same methods, undecorated.

    torch wraps ``step``, ``zero_grad``, ``add_param_group`` and ``(load_)state_dict`` in guards for
    ``torch.compile`` that import ``torch._dynamo`` on first use, which takes about as long as importing
    torch itself, for nothing in eager mode (they are graph breaks, and ``step``'s sets grad mode off,
    which ``eager_step`` does too). The arithmetic, the state dict and the step hooks are torch's own.
    A torch whose methods are built differently gets ``cls`` unchanged.
    """
    base = torch.optim.Optimizer
    plain = {name: getattr(getattr(base, name), "__wrapped__", None) for name in _PLAIN_METHODS}
    step = inspect.unwrap(cls.step)
    if any(fn is None for fn in plain.values()) or step is cls.step:
        return cls

    def eager_step(self, closure=None):
        with torch.no_grad():
            return step(self, closure)

    doc = f"torch.optim.{cls.__name__} without its torch.compile guards (see engine.eager)"
    return type(cls.__name__, (cls,), {**plain, "step": eager_step, "__module__": __name__, "__doc__": doc})


def make_optimizer(cfg: TrainConfig, params, device: torch.device) -> torch.optim.Optimizer:
    """The configured optimizer on its fastest deterministic path, ready without importing torch._dynamo.

    Fused kernels read and write each tensor once per step; on CPU (torch >= 2.4) that makes Adam's
    step ~3x faster than ``foreach`` for the MLP, where the optimizer is a large part of the step. Older
    torch has fused kernels for CUDA only and gets the multi-tensor path instead.
    """
    params = list(params)

    def build(**fast: bool) -> torch.optim.Optimizer:
        if cfg.optimizer == "adam":
            return eager(torch.optim.Adam)(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fast)
        if cfg.optimizer == "adamw":
            return eager(torch.optim.AdamW)(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fast)
        return eager(torch.optim.SGD)(
            params, lr=cfg.lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay, **fast
        )

    try:
        return build(fused=True)
    except RuntimeError:  # "`fused=True` requires ... supported devices": this torch has none for the device
        return build(foreach=True)


def wrap_ddp(
    model: nn.Module,
    device: torch.device,
    world_size: int,
    warmup: Callable[[nn.Module], torch.Tensor] | None = None,
) -> nn.Module:
    """The module the training step calls: DDP across ranks, the bare model for one process.

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
        **no_buffer_sync,
        **({"bucket_cap_mb": cap} if cap is not None else {}),
    )
    if warmup is not None:
        settle_buckets(ddp, model, lambda: warmup(ddp))
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


def settle_buckets(ddp: nn.Module, model: nn.Module, loss_of: Callable[[], torch.Tensor]) -> None:
    """One throwaway backward, so that every real step reduces gradients in DDP's final bucket layout.

    DDP sums gradients in the layout of its buckets and rebuilds that layout after the first backward
    (in the order the gradients became ready). With three or more ranks the layout decides in which
    order the ranks' float gradients are added, so the first step of each launch would round
    differently from the same step of an uninterrupted run, and a resumed run would not end
    bit-identical. ``loss_of`` runs the task's own step on a real batch (through ``ddp``). Eval mode:
    no dropout, no batch-norm statistics update; every RNG stream is put back (an augmentation in the
    step must draw the same numbers in the first real step); gradients dropped.
    """
    was_training = model.training
    model.eval()
    saved = rng_states()
    try:
        loss_of().float().sum().backward()
    finally:
        set_rng_states(saved)
        model.train(was_training)
        model.zero_grad(set_to_none=True)


def rng_states() -> tuple[Any, ...]:
    import random

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return random.getstate(), torch.get_rng_state(), cuda, _numpy_state()


def set_rng_states(saved: tuple[Any, ...]) -> None:
    import random

    py, cpu, cuda, np_state = saved
    random.setstate(py)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if np_state is not None:
        import numpy as np

        np.random.set_state(np_state)


def _numpy_state() -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    return np.random.get_state()


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    if cfg.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=cfg.lr, total_steps=max(total_steps, 2), pct_start=0.25, cycle_momentum=False
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
    precision: str = "fp32",
) -> Callable[[Any], torch.Tensor]:
    """Return ``step(batch) -> loss``: the task's loss (``loss_of(model, batch)``), backward, optimizer and
    schedule steps. Nothing in it waits for the device: the loss comes back as a tensor."""
    cast = autocast(device, precision)

    def step(batch: Any) -> torch.Tensor:
        with cast:
            loss = loss_of(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.detach()

    return step


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Any],
    metrics_of: Callable[[nn.Module, Any], dict[str, torch.Tensor]],
    device: torch.device,
    world_size: int,
    precision: str = "fp32",
) -> tuple[dict[str, float], int]:
    """Exact distributed evaluation: per-sample metric sums over this rank's shard, added over ranks,
    divided by the number of samples (every sample counted once whatever the world size).

    ``model`` must be the bare module, not the DDP wrapper (ranks hold shards of unequal size). Every
    rank first takes rank 0's buffers: batch-norm statistics drift apart between ranks during training
    (see ``wrap_ddp``), and the model evaluated must be the one rank 0 checkpoints. Returns
    (metrics, samples).
    """
    if world_size > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    was_training = model.training
    model.eval()
    names: list[str] | None = None
    totals = torch.zeros(1, dtype=torch.float64, device=device)  # [samples, metric sums ...]
    with autocast(device, precision):
        for batch in batches:
            sums = metrics_of(model, batch)
            if names is None:
                names = sorted(sums)
                totals = torch.zeros(1 + len(names), dtype=torch.float64, device=device)
            totals[0] += batch_size_of(batch)
            for i, name in enumerate(names, 1):
                totals[i] += sums[name].detach().double().sum()
    if world_size > 1:
        layout: list[Any] = [names]
        dist.broadcast_object_list(layout, src=0)  # a rank whose shard is empty learns the metric names
        if names is None:
            names = layout[0] or []
            totals = torch.zeros(1 + len(names), dtype=torch.float64, device=device)
        dist.all_reduce(totals)
    names = names or []
    model.train(was_training)
    values = totals.tolist()
    count = int(values[0])
    return {name: v / max(count, 1) for name, v in zip(names, values[1:])}, count


FLAGS = 4  # requeue signal, terminate signal, non-finite loss, checkpoint writer failed


class StopVote:
    """The ranks' agreement on stopping, reached one step late so that it never holds a step up.

    After each step every rank posts its flags (stop signal for requeue, SIGTERM, loss not finite)
    and starts a MAX all-reduce without waiting; ``exchange`` returns the agreed flags of the step
    before, which every rank posted a whole step ago, so reading them costs no wait for the slowest
    rank (a blocking all-reduce per step did: 1-3 ms of a 40 ms step at 2 CPU ranks). Every rank reads
    the same flags after the same step, so all still stop together, one step after the signal. With
    ``wait=True`` (before an evaluation or a checkpoint) the step's own flags are awaited as well, so
    nothing non-finite is evaluated or saved.

    On a GPU the flags never make the host wait for the current step: a side stream waits (on the
    device) for the all-reduce, copies the result into pinned host memory without blocking and
    records an event; one step later the host waits on that event, which the GPU passed while it was
    already running the next step. The host stays at most one step ahead of the device, and no call
    here synchronises a stream or the device (``torch.cuda.set_sync_debug_mode("error")`` passes:
    tests/test_gpu.py). Only ``wait=True`` and ``settle`` wait for the step just posted.
    """

    def __init__(
        self, stop: StopFlag, world_size: int, device: torch.device, failed: Callable[[], bool] | None = None
    ) -> None:
        """``failed``: a fourth flag any rank may raise (rank 0's background checkpoint writer failed);
        once agreed, ``self.failed`` stays True on every rank."""
        self.stop, self.world_size, self._failed = stop, world_size, failed
        self.bad = ""  # why the loss was flagged, once it was: "loss is nan at step 12"
        self.failed = False
        self._buffers = (torch.zeros(FLAGS, device=device), torch.zeros(FLAGS, device=device))  # posted, being reduced
        self._cuda = _HostCopies(device) if device.type == "cuda" else None
        self._pending: tuple[int, Any, torch.Tensor | None, int] | None = None  # slot, work, loss, step

    def exchange(self, loss: torch.Tensor | None, step: int, wait: bool = False) -> tuple[bool, bool, bool]:
        """Post this rank's flags after ``step``; return the agreed (requeue, terminate, non-finite)
        of the step before (all False the first time), or with ``wait`` of this step too."""
        previous = self._pending
        slot = 1 if previous is not None and previous[0] == 0 else 0
        flags = self._buffers[slot]
        flags[0] = float(self.stop.requeue_requested)
        flags[1] = float(self.stop.terminate_requested)
        flags[2] = 0.0 if loss is None else (~torch.isfinite(loss)).float()
        flags[3] = float(self._failed is not None and self._failed())
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True) if self.world_size > 1 else None
        if self._cuda is not None:
            self._cuda.post(slot, flags, work)
            work = None  # the side stream waits for it
        self._pending = (slot, work, loss, step)
        agreed = self._collect(previous)
        if wait:
            agreed = tuple(a or b for a, b in zip(agreed, self.settle()))
        return agreed  # type: ignore[return-value]

    def settle(self) -> tuple[bool, bool, bool]:
        """Wait for the last posted flags and return them agreed: no collective is left in flight."""
        pending, self._pending = self._pending, None
        return self._collect(pending)

    def _collect(self, pending: tuple[int, Any, torch.Tensor | None, int] | None) -> tuple[bool, bool, bool]:
        if pending is None:
            return False, False, False
        slot, work, loss, step = pending
        if self._cuda is not None:
            values = self._cuda.read(slot)
        else:
            if work is not None:
                work.wait()
            values = self._buffers[slot].tolist()
        requeue, terminate, bad, failed = (v > 0 for v in values)
        self.failed = self.failed or failed
        if bad and not self.bad:
            value = loss.item() if loss is not None else float("nan")  # the failure path may wait
            self.bad = (
                f"loss is {value} at step {step}"
                if not math.isfinite(value)
                else f"loss is not finite on another rank at step {step}"
            )
        return requeue, terminate, bad


class _HostCopies:
    """The CUDA side of :class:`StopVote`: per slot, pinned host memory filled by an asynchronous copy
    on a side stream, and the event that says the copy has landed."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.host = tuple(torch.zeros(FLAGS, pin_memory=True) for _ in range(2))
        self.done = tuple(torch.cuda.Event() for _ in range(2))

    def post(self, slot: int, flags: torch.Tensor, work: Any) -> None:
        """Copy ``flags`` to the host once the all-reduce ``work`` (None: none) is done, without the host
        or the training stream waiting for it."""
        self.stream.wait_stream(torch.cuda.current_stream(flags.device))  # the flags were written there
        with torch.cuda.stream(self.stream):
            if work is not None:
                work.wait()  # NCCL: this stream waits for the collective; the host does not
            self.host[slot].copy_(flags, non_blocking=True)
            self.done[slot].record(self.stream)
        # ``flags`` lives as long as the vote and is written again only two posts later, after ``read`` of
        # this slot has waited for the copy: no record_stream needed.

    def read(self, slot: int) -> list[float]:
        self.done[slot].synchronize()  # a step after the post: long passed, unless the host is far ahead
        return self.host[slot].tolist()
