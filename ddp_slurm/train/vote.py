"""The ranks' agreement on stopping (stop signals, a non-finite loss, a failed checkpoint write), reached
one step late so that it never holds a step up, and on a GPU without the host waiting for the device.
The same exchange carries each rank's loss, so the step's mean loss over the ranks reaches the host one
step late at no cost (the guard's spike detection reads it: ``guard/``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.train.signals import StopFlag

FLAGS = 5  # requeue signal, terminate signal, non-finite loss, checkpoint writer failed; the loss (summed)


class StopVote:
    """The ranks' agreement on stopping, reached one step late so that it never holds a step up.

    After each step every rank posts its flags (stop signal for requeue, SIGTERM, loss not finite) and
    its loss, and starts a SUM all-reduce without waiting (a flag is raised when its sum is above 0); ``exchange`` returns the agreed flags of the step
    before, which every rank posted a whole step ago, so reading them costs no wait for the slowest
    rank (a blocking all-reduce per step did: 1-3 ms of a 40 ms step at 2 CPU ranks). Every rank reads
    the same flags after the same step, so all still stop together, one step after the signal. With
    ``wait=True`` (before an evaluation or a checkpoint) the step's own flags are awaited as well, so
    nothing non-finite is evaluated or saved.

    On a GPU the flags never make the host wait for the current step: the host's flags reach the
    device buffer through pinned memory and one asynchronous copy (``_Staged``; the non-finite flag is
    computed on the device from the loss), a side stream waits (on the device) for the all-reduce,
    copies the result into pinned host memory without blocking and records an event; one step later
    the host waits on that event, which the GPU passed while it was already running the next step. The host stays at most one step ahead of the device, and no call
    here synchronises a stream or the device (``torch.cuda.set_sync_debug_mode("error")`` passes:
    tests/test_gpu_path.py; tests/test_step.py checks on CPU that no Python number is written into
    the device buffer). Only ``wait=True`` and ``settle`` wait for the step just posted.

    One rank (CPU or CUDA) has nothing to agree on, but must still notice a stop and a non-finite loss,
    one step late as above: its flags stay Python numbers and only the loss goes to the host, one copy
    per step (``_Solo``), checked there when read. No flags buffer, no collective, no side stream: the
    one op a step adds (``bench overhead`` counts it; tests/test_bench.py bounds it).
    """

    def __init__(
        self,
        stop: StopFlag,
        world_size: int,
        device: torch.device,
        failed: Callable[[], bool] | None = None,
        group: Any = None,
    ) -> None:
        """``failed``: a fourth flag any rank may raise (rank 0's background checkpoint writer failed);
        once agreed, ``self.failed`` stays True on every rank. ``group``: the training group (the flags
        live on the training device)."""
        self.stop, self.world_size, self._failed, self.group = stop, world_size, failed, group
        self.bad = ""  # why the loss was flagged, once it was: "loss is nan at step 12"
        self.bad_step = 0  # and at which step
        self.losses: deque[tuple[int, float]] = deque(maxlen=4)  # (step, mean loss over the ranks), as agreed
        self.failed = False
        # One rank (on CPU or CUDA): nothing to agree on, so no flags in device memory, no collective, no side
        # stream; only the loss travels to the host (``_Solo``: one copy per step). Other devices ("meta"
        # stands in for one in the tests) take the multi-rank device path.
        self._solo = _Solo(device) if world_size == 1 and device.type in ("cpu", "cuda") else None
        solo = self._solo is not None
        self._buffers = (torch.zeros(FLAGS, device=device), torch.zeros(FLAGS, device=device))  # posted, being reduced
        self._staged = _Staged(device) if device.type != "cpu" and not solo else None
        self._cuda = _HostCopies(device) if device.type == "cuda" and not solo else None
        self._pending: tuple[int, Any, torch.Tensor | None, int] | None = None  # slot, work, loss, step
        self._local: list[tuple[float, ...]] = [(0.0,) * FLAGS, (0.0,) * FLAGS]  # one rank: the host flags as posted

    def exchange(self, loss: torch.Tensor | None, step: int, wait: bool = False) -> tuple[bool, bool, bool]:
        """Post this rank's flags after ``step``; return the agreed (requeue, terminate, non-finite)
        of the step before (all False the first time), or with ``wait`` of this step too."""
        previous = self._pending
        slot = 1 if previous is not None and previous[0] == 0 else 0
        requeue, terminate = float(self.stop.requeue_requested), float(self.stop.terminate_requested)
        failed = float(self._failed is not None and self._failed())
        if self._alone:  # one rank: the flags stay Python numbers, the loss goes to the host
            self._local[slot] = (requeue, terminate, 0.0, failed, 0.0)
            self._solo.post(slot, loss)  # type: ignore[union-attr]
            self._pending = (slot, None, loss, step)
        else:
            self._post(slot, loss, step, (requeue, terminate, failed))
        agreed = self._collect(previous)
        if wait:
            agreed = tuple(a or b for a, b in zip(agreed, self.settle()))
        return agreed  # type: ignore[return-value]

    @property
    def _alone(self) -> bool:
        return self._solo is not None and self._staged is None

    def _post(self, slot: int, loss: torch.Tensor | None, step: int, host: tuple[float, float, float]) -> None:
        """Several ranks: the flags into the slot's buffer and its all-reduce started, without waiting."""
        requeue, terminate, failed = host
        flags = self._buffers[slot]
        if self._staged is None:  # CPU: the loss is readable at once, and one copy beats five element writes
            value = 0.0 if loss is None else loss.item()
            bad = float(not math.isfinite(value))
            flags.copy_(torch.tensor((requeue, terminate, bad, failed, value)))
        else:  # a device buffer: a Python number written into it is a synchronising copy (see _Staged)
            self._staged.post(slot, flags, (requeue, terminate, 0.0, failed, 0.0))
            if loss is not None:
                flags[2:3].copy_(~torch.isfinite(loss.reshape(1)))  # computed on the loss's device, no wait
                flags[4:5].copy_(loss.reshape(1))
        work = (
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            if self.world_size > 1
            else None
        )
        if self._cuda is not None:
            self._cuda.post(slot, flags, work)
            work = None  # the side stream waits for it
        self._pending = (slot, work, loss, step)

    def settle(self) -> tuple[bool, bool, bool]:
        """Wait for the last posted flags and return them agreed: no collective is left in flight."""
        pending, self._pending = self._pending, None
        return self._collect(pending)

    def take_losses(self) -> list[tuple[int, float]]:
        """The (step, mean loss over the ranks) agreed since the last call, oldest first; forgotten here."""
        losses = list(self.losses)
        self.losses.clear()
        return losses

    def reset(self) -> None:
        """Wait for the flags in flight and forget them, the losses and the non-finite verdict (the guard asks,
        going back: what the ranks agreed before a rollback says nothing of the steps after it)."""
        self.settle()
        self.losses.clear()
        self.bad = ""

    def _collect(self, pending: tuple[int, Any, torch.Tensor | None, int] | None) -> tuple[bool, bool, bool]:
        if pending is None:
            return False, False, False
        slot, work, loss, step = pending
        if self._cuda is not None:
            values = self._cuda.read(slot)
        elif self._alone:
            value = 0.0 if loss is None else self._solo.read(slot)  # type: ignore[union-attr]
            requeue, terminate, _, failed, _ = self._local[slot]
            values = (requeue, terminate, float(not math.isfinite(value)), failed, value)
        else:
            if work is not None:
                work.wait()
            values = self._buffers[slot].tolist()
        requeue, terminate, bad, failed = (v > 0 for v in values[:4])
        if loss is not None:
            self.losses.append((step, values[4] / self.world_size))
        self.failed = self.failed or failed
        if bad and not self.bad:
            self.bad_step = step
            value = _failed_value(loss)
            self.bad = (
                f"loss is {value} at step {step}"
                if not math.isfinite(value)
                else f"loss is not finite on another rank at step {step}"
            )
        return requeue, terminate, bad


def _failed_value(loss: torch.Tensor | None) -> float:
    """The non-finite loss as a number for its line. The failure path may wait for the device, also under
    ``DDP_SLURM_SYNC_DEBUG=error`` (hooks/syncdebug.py), whose mode is set aside for this one read: the run
    ends on "loss is nan at step N", not on the sync-debug error the read would raise."""
    if loss is None:
        return float("nan")
    if loss.device.type != "cuda":
        return loss.item()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return loss.item()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class _Solo:
    """One rank's loss on its way to the host: the one copy per step a single rank needs (the flags
    are Python numbers; the non-finite check is made on the host once the value is there).

    On CUDA the copy goes into pinned memory without blocking, on the training stream, and an event
    marks its landing; ``read``, a step later, waits on that event, which the device passed long before.
    A slot's memory is written again two posts later, after ``read`` of that slot: no race. On CPU it
    is a plain copy: the same one op per step a GPU launches (``bench overhead`` counts it there).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host: list[torch.Tensor | None] = [None, None]  # made at the first post, in the loss's dtype
        self.done = tuple(torch.cuda.Event() for _ in range(2)) if self.cuda else None

    def post(self, slot: int, loss: torch.Tensor | None) -> None:
        if loss is None:  # a skipped step (guard): nothing to copy
            return
        loss = loss.detach() if loss.requires_grad else loss  # the step's is already: no op
        loss = loss if loss.dim() == 0 else loss.reshape(())
        buffer = self.host[slot]
        if buffer is None or buffer.dtype != loss.dtype:
            buffer = self.host[slot] = torch.empty((), dtype=loss.dtype, pin_memory=self.cuda)
        buffer.copy_(loss, non_blocking=self.cuda)
        if self.done is not None:
            self.done[slot].record()

    def read(self, slot: int) -> float:
        if self.done is not None:
            self.done[slot].synchronize()  # a step after the post: long passed, unless the host is far ahead
        buffer = self.host[slot]
        assert buffer is not None
        return float(buffer.tolist())  # host memory: no device op


class _Staged:
    """The host's flags on their way into a device buffer without the host waiting.

    ``buffer[0] = 1.0`` on a CUDA tensor makes a pageable CPU scalar and copies it synchronously: three
    such writes per step were the only host syncs in a steady-state step. Here the host writes the
    flags into pinned memory (one per slot) and one asynchronous copy per step carries them over. A
    slot's staging memory is written again two posts later, after ``StopVote._collect`` has waited for
    that slot's event, which the device records after this copy: the copy has read it by then.
    """

    def __init__(self, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = tuple(torch.zeros(FLAGS, pin_memory=pin) for _ in range(2))

    def post(self, slot: int, flags: torch.Tensor, values: tuple[float, ...]) -> None:
        stage = self.host[slot]
        stage.copy_(torch.tensor(values))  # host memory only; one copy is cheaper than four element writes
        flags.copy_(stage, non_blocking=True)


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
