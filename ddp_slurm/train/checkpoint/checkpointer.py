"""The owner of the ``checkpoint`` config section: when a run saves, where, how many it keeps, and how.

The loop asks two things: ``due(step, end_of_epoch)`` (save after this step?) and ``save(state,
urgent=...)`` (write it; ``urgent`` for the saves the process waits for next: a stop signal, the end
of training). Everything the section says is decided here and nowhere else:

- cadence: every ``checkpoint.every_steps`` steps (0: off) and at the end of every epoch;
- ``checkpoint.keep``: pruning after each durable write (``format.save``);
- ``checkpoint.async``: in the background, at most one write in flight (``writer.AsyncCheckpointer``),
  or in the caller's thread;
- the run directory and ``run.shared`` (``RunPaths``): where, and with which file modes;
- ``dist.strategy=fsdp`` (``sharded=True``): folders of shards that every rank writes and rank 0 commits
  (``sharded_writer.ShardedCheckpointer``); ``save`` is then a collective.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint.format import CheckpointError
from ddp_slurm.train.checkpoint.writer import AsyncCheckpointer, Writer

log = logging.getLogger(__name__)


class CheckpointSection(Protocol):
    """What the checkpoint config section holds (``config.CheckpointConfig``)."""

    every_steps: int
    keep: int
    async_save: bool


class Checkpointer:
    """Decides when to save and saves; built on every rank, writes only where ``save`` is called (rank 0).

    ``stop_pending()``: a stop signal came (a save's wait for the previous write cancels it instead).
    ``writer``, ``on_durable``: passed to ``AsyncCheckpointer`` (the benchmark chooses the writer).
    """

    def __init__(
        self,
        section: CheckpointSection,
        paths: RunPaths,
        *,
        stop_pending: Callable[[], bool] | None = None,
        writer: Writer | None = None,
        on_durable: Callable[[Path, float], None] | None = None,
        sharded: bool = False,
    ) -> None:
        self.every_steps, self.paths = section.every_steps, paths
        self._root: tuple[int, int] | None = None  # the run directory's (device, inode) at the last save
        if sharded:
            from ddp_slurm.train.checkpoint.sharded_writer import ShardedCheckpointer

            self._writer: Any = ShardedCheckpointer(paths.root, section.keep, section.async_save, shared=paths.shared)
            return
        self._writer = AsyncCheckpointer(
            paths.root,
            section.keep,
            enabled=section.async_save,
            writer=writer,
            on_durable=on_durable,
            shared=paths.shared,
            stop_pending=stop_pending,
        )

    def due(self, step: int, end_of_epoch: bool) -> bool:
        """Whether the state after ``step`` is saved: at the end of an epoch, and every ``every_steps``."""
        return end_of_epoch or bool(self.every_steps and step % self.every_steps == 0)

    def save(
        self, state: dict[str, Any] | tuple[dict[str, Any], dict[str, Any] | None], urgent: bool = False
    ) -> Path | None:
        """Write ``state`` (``state['step']`` names it): synchronously (its path, logged here) or handed to
        the background writer (None; logged when durable). ``urgent``: the caller waits for it next, so
        an older write still in flight is cancelled and this one runs at full priority."""
        # a sharded snapshot is (this rank's shards, rank 0's record): the step is in the record, on rank 0
        record = state[1] if isinstance(state, tuple) else state
        self._same_run_dir(record["step"] if record is not None else None)
        path = self._writer.save(state, urgent=urgent)
        self._root = _identity(self.paths.root)
        if path is not None:
            log.info("checkpoint %s", path)
        return path

    def _same_run_dir(self, step: int | None) -> None:
        """CheckpointError when the run directory of the previous save is gone or another one: deleted or
        moved while training. Saving on would recreate it bare (no config, metrics or lock) and the run
        would end "finished" in a directory nobody looks at."""
        if self._root is not None and _identity(self.paths.root) != self._root:
            raise CheckpointError(
                f"cannot write checkpoint {self.paths.checkpoint(step) if step is not None else 'files'}: the run directory {self.paths.root} is "
                "gone (deleted or moved while the run was training); stopping without recreating it: restore it "
                "or launch again to start over"
            )

    @property
    def failed(self) -> bool:
        """The write in flight failed (not raised yet): for the ranks' stop vote."""
        return self._writer.failed

    @property
    def in_flight(self) -> bool:
        return self._writer.in_flight

    def wait(self) -> Path | None:
        """Block until the write in flight is durable; its path, or its CheckpointError."""
        return self._writer.wait()

    def close(self) -> None:
        """Wait for the write in flight and release the host buffers; raises the write's error."""
        self._writer.close()


def _identity(folder: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
