"""Every rank's side of writing sharded checkpoints (``dist.strategy=fsdp``): DCP writes this rank's shards
(in the background with ``checkpoint.async``) into a partial folder, seals the files it wrote, and rank 0
commits the folder once every rank's part is durable (``sharded.commit``). The format itself, reading and
verifying, is ``sharded.py``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm import safefs
from ddp_slurm.distributed import groups
from ddp_slurm.hostmem import available_memory, share
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.slurmjob.badnodes import host_name
from ddp_slurm.train.checkpoint.dcp_safe import FAILED, unwrap
from ddp_slurm.train.checkpoint.errors import CheckpointError
from ddp_slurm.train.checkpoint.sharded import commit, file_seal, fresh_partial, write_json
from ddp_slurm.train.checkpoint.snapshot import state_bytes
from ddp_slurm.train.checkpoint.wholefile_writer import MAX_SHARE_OF_AVAILABLE

log = logging.getLogger(__name__)


class _Recording:
    """A stream that keeps the first OSError of a write: torch's zip writer turns a failed write (ENOSPC,
    EIO) into "unexpected pos 704 vs 598" and loses the reason (as ``seal.Sink`` does for whole files)."""

    def __init__(self, stream: Any, errors: list[OSError]) -> None:
        self._stream, self._errors = stream, errors

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as exc:
            self._errors.append(exc)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _RecordingFS:
    """DCP's file system with every stream opened for writing a ``_Recording`` one."""

    def __init__(self, fs: Any, errors: list[OSError]) -> None:
        self._fs, self._errors = fs, errors

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._fs.create_stream(path, mode) as stream:
            yield _Recording(stream, self._errors) if "w" in mode else stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def _writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter

    class SealingWriter(FileSystemWriter):
        """DCP's file writer, which also seals the files this rank wrote once they are fsynced, and keeps
        the OSErrors its writes met (``errors``)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.errors: list[OSError] = []
            self.fs = _RecordingFS(self.fs, self.errors)

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            results = fut.wait()
            names = sorted({r.storage_data.relative_path for r in results})
            seals = {name: file_seal(Path(self.path) / name) for name in names}
            rank = dist.get_rank() if dist.is_initialized() else 0
            write_json(Path(self.path) / f"seal-{rank}.json", seals)
            return fut

    return SealingWriter


class ShardedCheckpointer:
    """Every rank's side of sharded checkpoints; the same calls as ``AsyncCheckpointer`` but ``save`` is
    a collective (every rank calls it at the same step), and rank 0 commits."""

    def __init__(
        self,
        paths: RunPaths,
        enabled: bool = True,
        *,
        prune: Callable[[Path], None] | None = None,
        **_: Any,
    ) -> None:
        """``prune(newest)``: rank 0, after each commit (the checkpointer's pruning, through the gate)."""
        self.paths, self.enabled, self.shared, self.prune = paths, enabled, paths.shared, prune
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = groups.gloo_group()  # background collectives, apart from training's, with the run's timeout
        self._stager: Any = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._step = -1
        self._started = 0.0
        self._done_at: float | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    @property
    def failed(self) -> bool:
        return self._thread is not None and not self._thread.is_alive() and self._error is not None

    def save(self, snapshot: tuple[dict[str, Any], dict[str, Any] | None], urgent: bool = False) -> Path | None:
        """Write this rank's shards of step ``record['step']`` (rank 0 also commits). Waits for the write in
        flight first. Returns the folder when synchronous (``checkpoint.async=false``), else None."""
        import torch.distributed.checkpoint as dcp

        shards, record = snapshot
        if self._thread is not None and self._thread.is_alive() and urgent:
            log.info("stop: waiting for the write of step %d (a sharded write cannot be cancelled)", self._step)
        self.wait()
        steps = [record["step"] if record is not None else -1]
        dist.broadcast_object_list(steps, src=0, group=self.group)
        step = int(steps[0])
        partial, final = self.paths.partial(step), self.paths.sharded(step)
        made: list[Any] = [None]
        if self.rank == 0:
            try:
                safefs.make_dir(self.paths.checkpoints, self.shared, parents=False)
                fresh_partial(partial, self.shared)
            except (OSError, safefs.UnsafePath) as exc:
                made[0] = f"cannot write checkpoint {final}: {getattr(exc, 'strerror', None) or exc}"
        dist.broadcast_object_list(made, src=0, group=self.group)  # the folder exists before any rank writes
        if made[0] is not None:
            raise CheckpointError(f"{made[0]}; previous checkpoints are intact")
        writer = _writer_class()(str(partial), sync_files=True)
        self._step, self._started, self._error, self._done_at = step, time.monotonic(), None, None
        if not self._asynchronous(shards):
            try:
                dcp.save(shards, storage_writer=writer, process_group=self.group)
            except FAILED as exc:  # DCP's CheckpointException: every rank gets it, with each rank's reason
                self._error = (
                    f"cannot write checkpoint {final}: {_reason(exc, writer)}; previous checkpoints are intact"
                )
                return self._collect()
            self._finish(None, partial, final, record, writer)
            return self._collect()
        future = dcp.async_save(shards, storage_writer=writer, process_group=self.group, async_stager=self._stage())
        future = getattr(future, "upload_completion", future)  # AsyncSaveResponse where staging is asynchronous
        self._thread = threading.Thread(
            target=self._finish, args=(future, partial, final, record, writer), name=f"ckpt-sharded-{step}"
        )
        self._thread.start()
        return None

    def _asynchronous(self, shards: dict[str, Any]) -> bool:
        """``checkpoint.async``, unless host copies of this rank's shards would take more than
        ``MAX_SHARE_OF_AVAILABLE`` of this rank's share of its host's memory on some rank (``fits``: pinned
        memory cannot be swapped out, and every rank of a node stages at once): then every save of the run
        is synchronous, one warning says so. Decided at the first save, agreed over the ranks (the two ways
        are different collectives); the copies made then are reused by every later save."""
        if not self.enabled or self._stager is not None:
            return self.enabled
        hosts: list[Any] = [None] * self.world
        dist.all_gather_object(hosts, host_name(), group=self.group)
        ranks = hosts.count(host_name())
        need, avail = state_bytes(shards), available_memory()
        here = fits(need, avail, ranks)
        agreed = torch.tensor([float(here)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        if not agreed.item():
            self.enabled = False
        if not agreed.item() and (self.rank == 0 or not here):  # rank 0 and the ranks that lack the memory
            mine = share(avail, None, ranks)
            log.warning(
                "checkpoint.async: host copies of the shards (%.0f MiB on this rank) would take more than half "
                "of a rank's share of its host's available memory (this one: %s MiB, its host's over %d "
                "rank(s)): saving synchronously",
                need / 2**20,
                "?" if mine is None else f"{mine / 2**20:.0f}",
                ranks,
            )
        return self.enabled

    def _stage(self) -> Any:
        """One stager for the run: host copies reused from save to save (``staging_options``)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager

            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._stager = DefaultStager(staging_options("cuda" if cuda else "cpu"))
        return self._stager

    def _finish(
        self, future: Future | None, partial: Path, final: Path, record: dict[str, Any] | None, writer: Any
    ) -> None:
        try:
            if future is not None:
                future.result()
            if self.rank == 0:
                assert record is not None
                commit(partial, final, record, self.world, self.shared)
                if self.prune is not None:
                    self.prune(final)
        except CheckpointError as exc:
            self._error = str(exc)
        except BaseException as exc:  # kept for the training thread
            self._error = f"cannot write checkpoint {final}: {_reason(exc, writer)}; previous checkpoints are intact"
        finally:
            self._done_at = time.monotonic()

    def poll(self) -> Path | None:
        if self._thread is None or self._thread.is_alive():
            return None
        return self.wait()

    def collect_durable(self) -> Path | None:
        """This rank's write once done (rank 0: committed), logged; else None. Never blocks or raises: a failed
        write is left for ``wait`` (``failed``)."""
        if self._thread is None or self._thread.is_alive() or self._error is not None:
            return None
        return self.wait()

    def settle(self) -> None:
        """Block until this rank's write in flight is done (rank 0: committed), no collective: every rank waits
        for its own shards before ``Checkpointer.wait`` asks rank 0, so that the ranks wait in a collective
        only for the commit, never for a write as long as the checkpoint is large (past ``dist.timeout_s``)."""
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> Path | None:
        """Block until this rank's write in flight is done (rank 0: committed); its folder, or CheckpointError."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        path = self._collect()
        log.info(
            "checkpoint %s written in the background (%.2f s after the save began)",
            path,
            (self._done_at or self._started) - self._started,
        )
        return path

    def _collect(self) -> Path:
        path = self.paths.sharded(self._step)
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(error)
        return path

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def fits(need: int, available: int | None, ranks_on_node: int) -> bool:
    """Whether ``need`` bytes of host copies fit ``MAX_SHARE_OF_AVAILABLE`` of one rank's share of what its
    node may still take (``available``, ``hostmem.available_memory``: MemAvailable or the cgroup's headroom,
    whichever is smaller), shared by the ``ranks_on_node`` ranks that stage at the same time. Unknown
    memory fits."""
    mine = share(available, None, ranks_on_node)
    return mine is None or need <= MAX_SHARE_OF_AVAILABLE * mine


def staging_options(device_type: str) -> Any:
    """DCP's staging for shards on ``device_type``. On CUDA: every shard's copy queued at once
    (non-blocking) into pinned host buffers reused from save to save, on the training stream behind the step
    that made them, and one wait for them all, on the training thread, at the save (a boundary: docs/gpu.md);
    a blocking copy per tensor would make the host wait once per tensor. Not DCP's background staging: its
    copies run on a side stream that does not wait for the training stream, while the next steps change
    the weights in place. On CPU the copies are plain (pinning and non-blocking copies need an accelerator)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    cuda = device_type == "cuda"
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )


def _reason(exc: BaseException, writer: Any) -> str:
    """Why a sharded write failed: the first OSError a write met (its reason, "No space left on device"),
    else the reason inside DCP's exception."""
    first = next((e for e in getattr(writer, "errors", []) if e.strerror), None)
    return first.strerror if first is not None else unwrap(exc)
