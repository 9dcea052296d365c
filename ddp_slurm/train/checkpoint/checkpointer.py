"""The one object the training loop asks about checkpoints: ``restore()`` once, ``due(...)`` and ``save(...)``
per step, ``wait()`` before it leaves.

It owns the ``checkpoint`` config section and everything a checkpoint of this run means, for either
backend (the strategy names it: one file written by rank 0, or a folder of every rank's shards):

- finding the newest checkpoint this run may resume from: through the gate (``gate.py``) with the
  run's own rules (its config, its model, its optimizer's and schedule's structure), on rank 0;
- restoring it into the run's objects (registered once, at construction) on every rank;
- cadence: every ``checkpoint.every_steps`` steps (0: off) and at the end of every epoch;
- saving: capturing the state (a collective), refusing non-finite weights, writing it in the background
  with ``checkpoint.async`` (at most one write in flight) or in the caller's thread; ``urgent`` for the
  saves the process waits for next (a stop signal, the end of training);
- ``checkpoint.keep``: pruning after each durable write, counting only this run's checkpoints (the gate's
  judgement again), never one a resume would not accept; the best checkpoint (``best.py``) is spared
  beside them, and named in the run directory's ``best`` once it is durable; with the guard on, so is the
  newest one a rollback could go back to (``hold`` steps before the newest);
- going back (``go_back``, the guard's rollback): the newest checkpoint before a step, through the gate,
  restored in this process on every rank, the newer ones set aside (``setaside.py``);
- the run directory and ``run.shared`` (``RunPaths``): where, and with which file modes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_slurm import errors
from ddp_slurm.distributed.group import on_rank0
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import best, fit, gate, listing, setaside, sharded, wholefile
from ddp_slurm.train.checkpoint.backends import Backend, Objects
from ddp_slurm.train.checkpoint.errors import CheckpointError
from ddp_slurm.train.checkpoint.state import Position

log = logging.getLogger(__name__)


class NonFiniteWeights(errors.Error):
    """The weights became NaN/inf: nothing is saved (the last good checkpoint is kept); exit 1."""


class Checkpointer:
    """Every rank builds one; see the module docstring.

    ``section``: the ``checkpoint`` config section; ``backend``: the strategy's; ``run``: the objects a
    checkpoint is captured from and restored into; ``cfg``: the run's config (a checkpoint records it,
    and only a config this run may resume counts as this run's); ``template``: the run's structure a
    checkpoint must fit (``fit.of_task``); ``stop_pending()``: a stop signal came (a save's wait for the
    previous write cancels it instead); ``hold``: with the guard on, its ``suspect_steps`` (pruning keeps the
    newest checkpoint at least that many steps before the newest, where a rollback would go).
    """

    def __init__(
        self,
        section: Any,
        paths: RunPaths,
        backend: Backend,
        run: Objects,
        cfg: Any,
        *,
        template: fit.Template | None = None,
        stop_pending: Callable[[], bool] | None = None,
        hold: int = 0,
    ) -> None:
        self.every_steps, self.paths, self.backend, self.run, self.cfg = section.every_steps, paths, backend, run, cfg
        self.keep, self.hold = section.keep, hold
        self.saved_step = -1  # the step of the newest checkpoint saved or restored by this launch
        self._root: tuple[int, int] | None = None  # the run directory's (device, inode), from the first save on
        self.reference = {k: tuple(v) for k, v in sharded.model_shapes(run.model).items()}
        self.gate = gate.Gate(
            backend,
            paths,
            [gate.same_config(cfg), gate.same_model(self.reference)],
            template=template,
            parts=getattr(run, "parts", None),  # the run's parts, those registered later too
        )
        self._seen: dict[Any, Any] = {}  # pruning's verdicts on the kept entries, by identity
        self._best_of: dict[int, int | None] = {}  # step saved -> the step of the best checkpoint then
        self._writer = backend.writer(paths, section, stop_pending=stop_pending, prune=self.prune)

    # -- finding and restoring -----------------------------------------------------------------
    def conflict(self) -> str | None:
        """Why this run directory cannot be resumed by this run's backend (it holds the other one's)."""
        return gate.foreign_kind(self.paths, self.backend)

    def has_checkpoints(self) -> bool:
        """Whether the run directory holds anything that looks like one of this backend's checkpoints."""
        return bool(self.backend.candidates(self.paths))

    def find(self) -> tuple[Path, dict[str, Any]] | None:
        """Rank 0, once the run directory is taken: clear what a killed writer left, then the newest
        checkpoint this run may resume from (None: a fresh start). Raises the gate's errors."""
        self.backend.remove_stale(self.paths)
        return self.gate.newest()

    def restore(self, found: Path | None, record: dict[str, Any] | None = None) -> Position | None:
        """Every rank: load the checkpoint rank 0 found (its ``record`` on rank 0; the others read it
        themselves, trusting rank 0's checks) into the run's objects; the position to continue from."""
        if found is None:
            return None
        if record is None:
            try:
                record = self.backend.read(found, verify=False)
            except ValueError as exc:  # it changed under us since rank 0 judged it
                raise CheckpointError(f"cannot read checkpoint {found}: {exc}") from None
        pos = self.backend.restore(found, record, self.run)
        self.saved_step = pos.step
        return pos

    def go_back(self, before: int) -> Position | None:
        """Every rank: restore the newest checkpoint of this run older than step ``before`` (the gate judges
        it on rank 0, which sets the newer ones aside); its position, or None when there is none."""
        self.wait()
        kept: dict[str, Any] = {}

        def find() -> Path | None:
            candidates = self.gate.candidates()
            self.gate.check_trust(candidates)
            for step, path in sorted(candidates, reverse=True):
                if step >= before:
                    continue
                try:
                    kept["record"] = record = self.gate.judge(step, path)
                except ValueError as exc:
                    log.warning("not going back to %s: %s", path, exc)
                    continue
                newer = sorted(p for s, p in candidates if s > step)
                if newer:
                    log.info("%s", setaside.set_aside(self.paths, step, newer, record.get("best_step")))
                return path
            return None

        found = on_rank0(self.run, find, self.run.groups.host)
        return self.restore(found, kept.get("record")) if found is not None else None

    # -- saving ---------------------------------------------------------------------------------
    def due(self, step: int, end_of_epoch: bool) -> bool:
        """Whether the state after ``step`` is saved: at the end of an epoch, and every ``every_steps``."""
        return end_of_epoch or bool(self.every_steps and step % self.every_steps == 0)

    def save(
        self, finished: bool, elapsed_s: float, extra: dict[str, Any] | None = None, urgent: bool = False
    ) -> Path | None:
        """Every rank, at the same step: capture the state and write it (rank 0 writes a whole file; every
        rank its shards). Returns the path when the write was synchronous (logged here), None when it was
        handed to the background writer (logged when durable). ``urgent``: the caller waits for it next.
        NonFiniteWeights (every rank) when the weights are not finite: nothing is written."""
        step = self.run.pos.step
        self._best_of[step] = self.run.pos.best_step
        try:
            snapshot: Any = self.backend.capture(self.run, finished, elapsed_s, extra or {})  # a collective
        except ValueError as exc:  # raised where the write happens, so that every rank raises it
            snapshot = NonFiniteWeights(f"{exc}: not saving them; the last good checkpoint is kept (lower train.lr?)")

        def write() -> Path | None:
            if isinstance(snapshot, NonFiniteWeights):
                raise snapshot
            self._same_run_dir(step)
            return self._writer.save(snapshot, urgent=urgent)

        path = self.backend.writes(self.run, write)
        self.saved_step = step
        if path is not None:
            log.info("checkpoint %s", path)
        return path

    def prune(self, newest: Path) -> None:
        """Rank 0, after each durable write: keep the ``checkpoint.keep`` newest of this run's own, and the
        best; name the best in the run directory when ``newest`` is it."""
        candidates = self.backend.candidates(self.paths)
        step = best.step_of(newest.name)
        best_step = self._best_of.pop(step, None) if step is not None else None
        for old in [s for s in list(self._best_of) if step is not None and s < step]:
            del self._best_of[old]  # written (or failed) before this one
        if best_step is not None and best_step == step:
            best.mark(self.paths, newest)
        spare = [p for s, p in candidates if s == best_step]
        if self.hold and step is not None:  # the guard's way back: step 0, and the newest before the suspect steps
            spare += [p for s, p in candidates if s == 0]  # docs/guard.md: always kept, whatever keep or the window
            spare += [p for s, p in sorted(candidates, reverse=True) if s <= max(0, step - self.hold)][:1]
        listing.prune(
            candidates,
            self.keep,
            newest,
            summary_of=self.backend.summary,
            judge=self.gate.judge_summary,
            remove=sharded.remove,
            seen=self._seen,
            spare=spare,
        )

    def _same_run_dir(self, step: int) -> None:
        """CheckpointError when the run directory of the previous save is gone or another one: deleted or
        moved while training. Saving on would recreate it bare (no config, metrics or lock) and the run
        would end "finished" in a directory nobody looks at. The identity is taken once, at the first save,
        and never again: taken after every save, it could be taken while the directory was gone, or once a
        background write had made a bare one in its place, and the loss would go unseen."""
        now = _identity(self.paths.root)
        if self._root is None:
            self._root = now
        if now is None or now != self._root:
            raise wholefile.gone(self.paths.root, self.paths.checkpoint(step))

    def poll(self) -> None:
        """Each step, rank 0, no collective, never blocks: a background write that has become durable is
        collected now, so that its line comes in order with the progress lines (it came at the next save,
        after the lines of every step between). A failed one is left for the stop vote (``failed``): the
        ranks raise it together."""
        if self.run.rank == 0:
            self._writer.collect_durable()

    @property
    def failed(self) -> bool:
        """This rank's write in flight failed (not raised yet): for the ranks' stop vote."""
        return self._writer.failed

    @property
    def in_flight(self) -> bool:
        return self._writer.in_flight

    def wait(self) -> Path | None:
        """Every rank: block until the write in flight is durable (rank 0 knows); its path, or its
        CheckpointError on every rank."""
        self._writer.settle()  # this rank's own part first, outside any collective
        return on_rank0(self.run, self._writer.wait, self.run.groups.host)

    def close(self) -> None:
        """This rank: wait for the write in flight and release the host buffers; raises the write's error."""
        self._writer.close()


def _identity(folder: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
