"""Asynchronous checkpoints: training pauses only until the state is frozen in host memory.

``AsyncCheckpointer.save(state)`` freezes the state and hands it to one background writer that runs
``checkpoint.save``: the same seal, temporary file, fsync, rename and pruning as a synchronous
save, so a reader or a relaunch after SIGKILL sees the previous checkpoints or the new one, never
half a file. At most one write is in flight: ``save`` first waits for the previous write, so host
memory never holds more than one extra copy of the state; a stop signal that comes during that wait
(``stop_pending``) cancels the previous write instead, so the stop checkpoint never queues behind it.

Two writers, measured side by side by ``python -m ddp_slurm.bench checkpoint`` (docs/checkpoints.md):
- ``writer="thread"`` (the default): the state is copied into host buffers that are kept and reused
  (pinned for GPU tensors: the copy is a DMA queued behind the step that made them), then a thread
  writes the copy. ``hashlib`` and file writes release the interpreter lock; pickling does not.
- ``writer="process"``: a forked child writes the state it sees copy-on-write, at nice +10, and dies
  with its parent (``PR_SET_PDEATHSIG``); it has its own interpreter lock.
  Its cost is hidden in the parent: each page training changes while the child lives costs a page
  fault and a 4 KiB copy, and an optimizer changes all of its state every step.
The thread is the default because it forks nothing (a process holding CUDA, NCCL and gloo state is
not one to fork, and the GPU path of the process writer is not measured) and its cost is visible
where it is paid. On the 2-core test machine the thread's stall was the smaller one at every size
measured (docs/checkpoints.md).
``save(state, urgent=True)`` is for the saves the process waits for next (a stop signal, the end of
training): the in-flight write of an older step is cancelled (a process is killed, a thread stops at
its next 16 MiB slice; the temporary file is removed: the checkpoint before it stays the newest
durable one until the urgent one is) and the new one runs at once, at full priority.

Failures: an error in the writer (disk full, read-only file system) is kept and raised by the next
``poll()`` (call it every step), ``save()``, ``wait()`` or ``close()`` as one-line
``checkpoint.CheckpointError``; the previous checkpoints stay intact, as with a synchronous save.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from ddp_slurm import safefs
from ddp_slurm.hostmem import available_memory
from ddp_slurm.train.checkpoint import wholefile as checkpoint
from ddp_slurm.train.checkpoint.snapshot import Snapshotter, on_gpu, state_bytes

log = logging.getLogger(__name__)

# Asynchronous saving is skipped (a synchronous save instead, with one warning) when a copy of the
# state would take more than this share of the host's available memory: swapping or the OOM killer
# would cost far more than the stall that is saved.
MAX_SHARE_OF_AVAILABLE = 0.5
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The writer process's nice increment for the checkpoints training does not wait for: the cores go to
# training first. Stop and final saves (urgent) run at the training process's own priority.
WRITER_NICE = 10

Writer = Literal["process", "thread"]


class _Write:
    """One write in flight: ``done()`` without blocking, ``join()``, then ``error`` (a one-line reason) or success."""

    def __init__(self, step: int) -> None:
        self.step, self.started = step, time.monotonic()
        self.error: str | None = None
        self.done_at: float | None = None

    def done(self) -> bool:
        raise NotImplementedError

    def join(self) -> None:
        raise NotImplementedError

    def join_for(self, seconds: float) -> None:
        """Wait at most ``seconds`` for the write to end."""
        deadline = time.monotonic() + seconds
        while not self.done() and time.monotonic() < deadline:
            time.sleep(0.01)

    def cancel(self, folder: Path) -> None:
        """Stop the write if it can be stopped; wait for it otherwise."""
        self.join()


class _ThreadWrite(_Write):
    def __init__(self, step: int, target: Callable[[threading.Event], Path], events: list[torch.cuda.Event]) -> None:
        super().__init__(step)
        self._cancel = threading.Event()
        # Not a daemon: an interpreter that exits normally (an exception out of main) joins it first.
        self._thread = threading.Thread(target=self._run, args=(target, events), name=f"ckpt-writer-{step}")
        self._thread.start()

    def _run(self, target: Callable[[threading.Event], Path], events: list[torch.cuda.Event]) -> None:
        try:
            for event in events:
                event.synchronize()
            target(self._cancel)
        except checkpoint.CheckpointError as exc:
            self.error = str(exc)
        except BaseException as exc:  # kept for the training thread: a thread's exception goes nowhere
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            self.done_at = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()

    def join_for(self, seconds: float) -> None:
        self._thread.join(seconds)

    def cancel(self, folder: Path) -> None:
        """checkpoint.save stops before its next 16 MiB slice (milliseconds) and removes its temporary file."""
        self._cancel.set()
        self.join()


class _ProcessWrite(_Write):
    def __init__(self, step: int, target: Callable[[], Path], nice: int) -> None:
        super().__init__(step)
        read, write = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: write, report, and leave without running any of the parent's cleanup
            code = 1
            try:
                os.close(read)
                _die_with(parent)
                if nice:
                    os.nice(nice)
                try:
                    target()
                    code = 0
                except checkpoint.CheckpointError as exc:
                    os.write(write, str(exc).encode()[:4000])
                except BaseException as exc:
                    os.write(write, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".encode())
            finally:
                os._exit(code)
        os.close(write)
        self.pid, self._read, self._status = pid, read, None

    def done(self) -> bool:
        if self._status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._finish(status)
        return self._status is not None

    def join(self) -> None:
        if self._status is None:
            self._finish(os.waitpid(self.pid, 0)[1])

    def cancel(self, folder: Path) -> None:
        if self._status is None:
            os.kill(self.pid, signal.SIGKILL)
            self.join()
        for tmp in folder.glob(
            safefs.temp_pattern(checkpoint.file_name(self.step), self.pid)
        ):  # what the killed child left
            tmp.unlink(missing_ok=True)

    def _finish(self, status: int) -> None:
        self._status, self.done_at = status, time.monotonic()
        with os.fdopen(self._read, "rb") as f:
            message = f.read().decode(errors="replace").strip()
        if os.waitstatus_to_exitcode(status) != 0:
            code = os.waitstatus_to_exitcode(status)
            self.error = message or (f"the writer process was killed by signal {-code}" if code < 0 else f"exit {code}")


def _die_with(parent: int) -> None:
    """Linux: the kernel SIGKILLs this process when the thread that forked it dies, so a SIGKILLed rank
    leaves no writer behind that would rename a checkpoint into place after a relaunch has started."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the writer may outlive a killed parent
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class AsyncCheckpointer:
    """Checkpoints written in the background, at most one in flight. Only the saving rank makes one.

    ``enabled=False`` makes every ``save`` synchronous (``checkpoint.save`` in the caller's thread), so
    the loop has one code path either way. ``on_durable(path, monotonic_time)`` is called in the
    caller's thread (by save, poll, wait or close) once per checkpoint that is on disk.
    """

    def __init__(
        self,
        run_dir: Path,
        keep: int,
        enabled: bool = True,
        *,
        writer: Writer | None = None,
        on_durable: Callable[[Path, float], None] | None = None,
        shared: bool = False,
        stop_pending: Callable[[], bool] | None = None,
        prune: Callable[[Path], None] | None = None,
        parents: bool = True,
    ) -> None:
        """``prune(newest)``: after each durable write, the caller's pruning (``wholefile.save``'s own without).
        ``parents=False``: the run directory exists (a training run took it), and one gone is not made again."""
        self.run_dir, self.keep, self.enabled, self.shared = Path(run_dir), keep, enabled, shared
        self.parents = parents
        self.stop_pending, self.prune = stop_pending, prune
        self.writer: Writer = writer or "thread"
        self.on_durable = on_durable
        self._snap = Snapshotter()
        self._write: _Write | None = None
        self._warned_memory = False
        self._seen: dict[Any, Any] = {}  # pruning's verdicts on the kept files (wholefile.prune)

    @property
    def in_flight(self) -> bool:
        """A write was started and its outcome was not collected yet (by poll, wait or close)."""
        return self._write is not None

    @property
    def writer_pid(self) -> int | None:
        """The process writing now (``writer="process"``), for measuring its memory."""
        return self._write.pid if isinstance(self._write, _ProcessWrite) and self._write._status is None else None

    @property
    def failed(self) -> bool:
        """The in-flight write has failed (not raised yet): for folding into the ranks' stop vote."""
        w = self._write
        return w is not None and w.done() and w.error is not None

    def save(self, state: dict[str, Any], urgent: bool = False) -> Path | None:
        """Checkpoint ``state`` (``state['step']`` names the file). Waits for the previous write first
        (raising its error), or cancels it once ``stop_pending()`` says a stop signal came. ``urgent``: the caller will wait for this write next (a stop signal, the
        end of training): an in-flight write of an older step is cancelled, and the write runs at full
        priority. Returns the path when the save was synchronous,
        None when it was handed to the writer (``wait()`` returns the path once it is durable)."""
        self._settle(int(state["step"]), urgent)
        step = int(state["step"])
        gpu = on_gpu(state)
        fits = self._fits(state, warn=self.enabled) if self.enabled or gpu else True
        if not self.enabled or not fits:
            if gpu and fits:  # checkpoint.async=false: torch.save of live CUDA tensors waits once per tensor
                state = self._on_host(state)
            return self._durable(
                checkpoint.save(
                    self.run_dir, state, self.keep, self.shared, seen=self._seen, prune=self.prune, parents=self.parents
                ),
                time.monotonic(),
            )
        checkpoint.check_room(self.run_dir, step, state_bytes(state))  # fails at this save, not steps later
        if self.writer == "process":
            # the child can read host memory only: copy, and wait for the copy
            frozen = self._on_host(state) if gpu else state
            target = lambda: checkpoint.save(  # noqa: E731
                self.run_dir, frozen, self.keep, self.shared, seen=self._seen, prune=self.prune, parents=self.parents
            )
            self._write = _ProcessWrite(step, target, 0 if urgent else WRITER_NICE)
        else:
            snap, events = self._snap.copy(state)
            self._write = _ThreadWrite(
                step,
                lambda cancel: checkpoint.save(
                    self.run_dir,
                    snap,
                    self.keep,
                    self.shared,
                    cancel=cancel,
                    seen=self._seen,
                    prune=self.prune,
                    parents=self.parents,
                ),
                events,
            )
        return None

    def _settle(self, step: int, urgent: bool) -> None:
        """Before a new write: wait for the one in flight (raising its error), or cancel it when this
        save is urgent or a stop signal comes meanwhile (``stop_pending``): the stop checkpoint that
        follows must not queue behind a write it supersedes."""
        w = self._write
        while w is not None and not w.done():
            if urgent or (self.stop_pending is not None and self.stop_pending()):
                log.info("stop: cancelling the write of step %d for the newer step %d", w.step, step)
                w.cancel(checkpoint.checkpoint_dir(self.run_dir))
                self._write = None
                return
            w.join_for(0.05)
        self.wait()

    def poll(self) -> Path | None:
        """Once per step: the path of a write that became durable since the last call (None otherwise);
        raises its CheckpointError if it failed. Never blocks."""
        if self._write is None or not self._write.done():
            return None
        return self._collect()

    def collect_durable(self) -> Path | None:
        """The path of the write in flight once it is durable (logged, pruned, ``on_durable`` called), else
        None. Never blocks and never raises: a failed write is left for ``wait`` (``failed`` says so)."""
        w = self._write
        if w is None or not w.done() or w.error is not None:
            return None
        return self._collect()

    def settle(self) -> None:
        """Nothing to wait for beside ``wait``: one rank writes the whole file (see ShardedCheckpointer.settle)."""

    def wait(self) -> Path | None:
        """Block until the in-flight write (if any) is durable; its path, or its CheckpointError."""
        if self._write is None:
            return None
        self._write.join()
        return self._collect()

    def close(self) -> None:
        """Wait for the in-flight write and release the host buffers. Raises the write's error."""
        try:
            self.wait()
        finally:
            self._snap.release()

    def _on_host(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with its GPU tensors copied into this writer's reused host buffers (pinned): every
        copy queued at once, then one wait for the last (they run in order on the one stream they were
        queued on). ``torch.save`` of the live CUDA state would instead wait for the device once per tensor."""
        host, events = self._snap.copy(state)
        if events:
            events[-1].synchronize()
        return host

    def _fits(self, state: dict[str, Any], warn: bool = True) -> bool:
        """Whether a host copy of ``state`` fits the host's available memory (``MAX_SHARE_OF_AVAILABLE``);
        ``warn``: say once that saving is synchronous because it does not."""
        need = state_bytes(state) - self._snap.held_bytes  # reused buffers are already counted
        avail = available_memory()
        if avail is None or need <= MAX_SHARE_OF_AVAILABLE * avail:
            return True
        if warn and not self._warned_memory:
            log.warning(
                "checkpoint.async: a copy of the state (%.0f MiB) would take more than half the host's "
                "available memory (%.0f MiB): saving synchronously",
                need / 2**20,
                avail / 2**20,
            )
            self._warned_memory = True
        return False

    def _collect(self) -> Path:
        w, self._write = self._write, None
        assert w is not None and w.done_at is not None
        path = checkpoint.checkpoint_dir(self.run_dir) / checkpoint.file_name(w.step)
        if w.error is not None:
            if not w.error.startswith("cannot write checkpoint"):  # not checkpoint.save's own one line
                w.error = f"cannot write checkpoint {path}: {w.error}; previous checkpoints are intact"
            raise checkpoint.CheckpointError(w.error)
        log.info("checkpoint %s written in the background (%.2f s after the save began)", path, w.done_at - w.started)
        return self._durable(path, w.done_at)

    def _durable(self, path: Path, at: float) -> Path:
        if self.on_durable is not None:
            self.on_durable(path, at)
        return path
