"""Asynchronous checkpoints: training pauses only to copy the state to host memory.

``AsyncCheckpointer.save(state)`` copies every tensor of ``state`` into host buffers (pinned where the
tensor lives on a GPU, so the copy is a DMA queued on the tensor's stream) and hands the copy to one
background writer thread, which runs ``checkpoint.save``: the same digest, temporary file, fsync,
rename and pruning as a synchronous save, so a reader or a relaunch after SIGKILL sees the previous
checkpoints or the new one, never half a file.

At most one write is in flight: ``save`` first waits for the previous write, so host memory never
holds more than one extra copy of the state. The buffers are kept and reused by the next save of a
state with the same layout (allocating and first-touching gigabytes, pinned ones above all, costs more
than copying into them).

A thread, not a forked process: ``hashlib`` releases the GIL while it hashes, and file writes and
``fsync`` release it while they wait for the disk, so the writer holds the GIL only for pickling the
small plain values and for the moments between system calls (``python -m ddp_slurm.bench checkpoint``
measures the slowdown of the training steps that run beside a write; see docs/checkpoints.md). A
thread also needs no fork of a process that holds gloo/NCCL threads and CUDA state.

Failures: an error in the writer (disk full, read-only file system) is kept and raised by the next
``poll()`` (call it every step), ``save()``, ``wait()`` or ``close()`` as one-line
``checkpoint.CheckpointError``; the previous checkpoints stay intact, as with a synchronous save.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddp_slurm.train import checkpoint

log = logging.getLogger(__name__)

# Asynchronous saving is skipped (a synchronous save instead, with one warning) when the state's copy
# would leave less than this share of the host's available memory: swapping or the OOM killer would
# cost far more than the stall that is saved.
MAX_SHARE_OF_AVAILABLE = 0.5


def state_bytes(state: Any) -> int:
    """Bytes of every tensor in ``state`` (nested dicts, lists, tuples)."""
    return sum(t.numel() * t.element_size() for _, t in checkpoint._tensors(state))


def available_memory() -> int | None:
    """``MemAvailable`` of the host in bytes (Linux), None where the OS does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Snapshotter:
    """Copies a nested state into host buffers it owns and reuses while the layout stays the same."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        self._buffers.clear()

    def copy(self, state: dict[str, Any]) -> tuple[dict[str, Any], list[torch.cuda.Event]]:
        """A copy of ``state`` whose tensors live in this snapshotter's host buffers, and the CUDA
        events the writer must wait for (GPU copies are queued, not finished, when this returns)."""
        events: list[torch.cuda.Event] = []
        seen: set[str] = set()
        snap = self._copy(state, "", events, seen)
        for stale in set(self._buffers) - seen:  # a layout that changed: do not keep both copies
            del self._buffers[stale]
        return snap, events

    def _copy(self, obj: Any, path: str, events: list[torch.cuda.Event], seen: set[str]) -> Any:
        if isinstance(obj, torch.Tensor):
            seen.add(path)
            return self._tensor(obj.detach(), path, events)
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v, f"{path}/{k}", events, seen)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self._copy(v, f"{path}/{i}", events, seen) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._copy(v, f"{path}/{i}", events, seen) for i, v in enumerate(obj))
        return copy.deepcopy(obj)  # plain values the loop may change after save() returns

    def _tensor(self, t: torch.Tensor, path: str, events: list[torch.cuda.Event]) -> torch.Tensor:
        buf = self._buffers.get(path)
        cuda = t.device.type == "cuda"
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.is_pinned() != cuda:
            # pinned host memory only for GPU tensors: pinning pageable CPU memory buys nothing
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
            self._buffers[path] = buf
        if cuda:
            buf.copy_(t, non_blocking=True)  # queued on the current stream, behind the step that made t
            event = torch.cuda.Event()
            event.record()
            events.append(event)
        else:
            buf.copy_(t)
        return buf


@dataclass
class _Write:
    step: int
    started: float
    thread: threading.Thread = field(init=False)
    path: Path | None = None
    error: BaseException | None = None
    done_at: float | None = None


class AsyncCheckpointer:
    """Checkpoints written by a background thread; at most one in flight. Only the saving rank makes one.

    ``enabled=False`` makes every ``save`` synchronous (``checkpoint.save`` in the caller's thread), so
    the loop has one code path either way.
    """

    def __init__(
        self,
        run_dir: Path,
        keep: int,
        enabled: bool = True,
        *,
        on_durable: Callable[[Path, float], None] | None = None,
    ) -> None:
        self.run_dir, self.keep, self.enabled = Path(run_dir), keep, enabled
        self.on_durable = on_durable  # called in the caller's thread, by poll/wait, once per written file
        self._snap = Snapshotter()
        self._write: _Write | None = None
        self._warned_memory = False

    @property
    def in_flight(self) -> bool:
        """A write was started and its outcome was not collected yet (by poll, wait or close)."""
        return self._write is not None

    @property
    def failed(self) -> bool:
        """The in-flight write has failed (not raised yet): for folding into the ranks' stop vote."""
        w = self._write
        return w is not None and not w.thread.is_alive() and w.error is not None

    def save(self, state: dict[str, Any]) -> Path | None:
        """Checkpoint ``state`` (``state['step']`` names the file). Waits for the previous write first
        (raising its error). Returns the path when the save was synchronous, None when it was handed
        to the writer (``wait()`` returns it once durable)."""
        self.wait()
        if not self.enabled or not self._fits(state):
            return self._durable(checkpoint.save(self.run_dir, state, self.keep), time.monotonic())
        started = time.monotonic()
        snap, events = self._snap.copy(state)
        write = _Write(step=int(state["step"]), started=started)
        # Not a daemon: an interpreter that exits normally (an exception out of main) joins it first,
        # so no exit path leaves a write behind that the process could have finished.
        write.thread = threading.Thread(
            target=self._run, args=(write, snap, events), name=f"ckpt-writer-{write.step}", daemon=False
        )
        self._write = write
        write.thread.start()
        return None

    def poll(self) -> Path | None:
        """Once per step: returns the path of a write that became durable since the last call (None
        otherwise) and raises its CheckpointError if it failed. Never blocks."""
        w = self._write
        if w is None or w.thread.is_alive():
            return None
        return self._collect()

    def wait(self) -> Path | None:
        """Block until the in-flight write (if any) is durable; its path, or its CheckpointError."""
        if self._write is None:
            return None
        self._write.thread.join()
        return self._collect()

    def close(self) -> None:
        """Wait for the in-flight write and release the host buffers. Raises the write's error."""
        try:
            self.wait()
        finally:
            self._snap.release()

    def _fits(self, state: dict[str, Any]) -> bool:
        need = state_bytes(state) - self._snap.held_bytes  # reused buffers are already counted
        avail = available_memory()
        if avail is None or need <= MAX_SHARE_OF_AVAILABLE * avail:
            return True
        if not self._warned_memory:
            log.warning(
                "checkpoint.async: a copy of the state (%.0f MiB) would not fit in half the host's available "
                "memory (%.0f MiB): saving synchronously",
                need / 2**20,
                avail / 2**20,
            )
            self._warned_memory = True
        return False

    def _run(self, write: _Write, snap: dict[str, Any], events: list[torch.cuda.Event]) -> None:
        try:
            for event in events:
                event.synchronize()
            write.path = checkpoint.save(self.run_dir, snap, self.keep)
        except BaseException as exc:  # kept for the training thread: a thread's exception goes nowhere
            write.error = exc
        finally:
            write.done_at = time.monotonic()

    def _collect(self) -> Path | None:
        w, self._write = self._write, None
        assert w is not None and w.done_at is not None
        if w.error is not None:
            if isinstance(w.error, checkpoint.CheckpointError):
                raise checkpoint.CheckpointError(str(w.error)) from None
            reason = str(w.error).splitlines()[0] if str(w.error) else ""
            raise checkpoint.CheckpointError(
                f"cannot write checkpoint step-{w.step}.pt in {checkpoint.checkpoint_dir(self.run_dir)}: "
                f"{type(w.error).__name__}: {reason}; previous checkpoints are intact"
            ) from None
        assert w.path is not None
        log.info("checkpoint %s written in the background (%.2f s after the save began)", w.path, w.done_at - w.started)
        return self._durable(w.path, w.done_at)

    def _durable(self, path: Path, at: float) -> Path:
        if self.on_durable is not None:
            self.on_durable(path, at)
        return path
