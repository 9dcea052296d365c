"""The one gate every checkpoint passes before anything of it is used, for every backend and every reader.

Resume, warm start, ``checkpoint.load_latest``, pruning and the tools all ask here; the rules live here
once, so a rule the file keeps is kept by the folder of shards too (the third audit found the folder
missing five of them). In order, for each candidate, newest first:

1. **trusted** (before anything is read, for every candidate): the folder, the file or the folder of
   shards and everything in it must be this user's (or, with ``run.shared``, the group's), not writable
   by others, plain files, no symlinks (``safefs.check_trusted``): whoever can write a checkpoint
   decides what the next launch loads. One that is not stops the launch (exit 2) naming the fix;
2. **whole**: the backend reads it: every byte under its seal, the file or commit record through
   ``torch.load(weights_only=True)``, a folder's shards named by its commit and agreeing with DCP's
   index, which is read without unpickling code (``dcp_safe``);
3. **where its name says**: the step inside is the step in its name;
4. **well formed** (for a resume): every value a resume reads has the right type and range
   (``schema.py``): a forged ``epoch=-3`` or ``finished='yes'`` is skipped, not resumed;
5. **this run's**: the caller's ``accept`` rules (its config may be resumed by this run, without
   importing anything: ``config.changes_from``; its model has this model's names and shapes);
6. **fits**: its optimizer's layout and its schedule are this run's (``fit.py``).

A candidate that fails 2-6 is skipped with a warning naming why, and the one before is tried; when
none passes, the launch stops instead of starting over (``NoneFits`` when each was whole but none
fits: exit 2; ``CheckpointError`` otherwise: exit 1), so finished work is never silently thrown away.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ddp_slurm import safefs
from ddp_slurm.exitcodes import EXIT_USAGE
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import fit, schema
from ddp_slurm.train.checkpoint.backends import BACKENDS, Backend
from ddp_slurm.train.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

Accept = Callable[[dict[str, Any]], None]  # raises ValueError naming why a record is not this run's
Shape = tuple[int, ...]


class UnsafeCheckpoint(CheckpointError, safefs.UnsafePath):
    """A checkpoint (or its folder) someone else could have written: a usage problem, exit 2, and still a
    CheckpointError for callers that catch those."""

    exit_code: ClassVar[int] = EXIT_USAGE


class NoneFits(CheckpointError):
    """Checkpoints exist, whole, but none fits this run's structure: a usage problem, exit 2."""

    exit_code: ClassVar[int] = EXIT_USAGE


@dataclass
class Gate:
    """The rules (see the module docstring) for the candidates of ``backend`` in ``paths``.

    ``accept``: the caller's judgement of a record (this run's config and model); ``template``: the run's
    structure that the optimizer and schedule must fit (None: not checked); ``resumable``: the record must
    hold everything a resume reads (``schema.check``; off for readers that only want the weights); ``parts``:
    the run's registered parts (``parts.Parts``), whose checks a record passes (None: the standard parts')."""

    backend: Backend
    paths: RunPaths
    accept: list[Accept] = field(default_factory=list)
    template: fit.Template | None = None
    resumable: bool = True
    parts: Any = None

    def candidates(self) -> list[tuple[int, Path]]:
        return self.backend.candidates(self.paths)

    def check_trust(self, candidates: Iterable[tuple[int, Path]]) -> None:
        """Rule 1 for every candidate at once, before any is read: UnsafeCheckpoint naming the first."""
        candidates = list(candidates)
        try:
            if candidates:
                safefs.check_trusted(self.paths.checkpoints, self.paths.shared)
            for _, path in candidates:
                self.backend.trust(path, self.paths.shared)
        except safefs.UnsafePath as exc:
            raise UnsafeCheckpoint(str(exc)) from None

    def judge(self, step: int | None, path: Path) -> dict[str, Any]:
        """Rules 2-6 for one trusted candidate: its record, or ValueError (``fit.DoesNotFit``) naming why not.
        ``step``: the step its name says (None: a checkpoint named by the user, not found by its name)."""
        record = self.backend.read(path)
        if step is not None and record["step"] != step:
            raise ValueError(f"it holds step {record['step']}, not the step its name says")
        if self.resumable:
            schema.check(record, self.backend.extra, None if self.parts is None else self.parts.checks())
        self.check(record)
        return record

    def check(self, record: dict[str, Any]) -> None:
        """Rules 5-6 on a whole record: ValueError (``fit.DoesNotFit``) naming why it is not the caller's."""
        view = dict(record, model_shapes=self.backend.shapes(record))
        for accept in self.accept:
            accept(view)
        if self.template is not None:
            fit.check(self.template, self.backend.layout(record), record.get("scheduler"))

    def newest(self) -> tuple[Path, dict[str, Any]] | None:
        """``(path, record)`` of the newest candidate that passes; None when there is none at all."""
        candidates = self.candidates()
        self.check_trust(candidates)
        unfit: list[str] = []
        for step, path in candidates:
            try:
                record = self.judge(step, path)
            except ValueError as exc:
                log.warning("skipping checkpoint %s: %s", path, exc)
                if isinstance(exc, fit.DoesNotFit):
                    unfit.append(f"{path}: {exc}")
                continue
            _say_owner(path)
            return path, record
        if candidates and len(unfit) == len(candidates):
            more = f" (and {len(unfit) - 1} more that do not fit)" if len(unfit) > 1 else ""
            raise NoneFits(
                f"no checkpoint fits this run: {unfit[0]}{more}; launch with the task's optimizer and schedule as "
                "they were, or choose a new run.name"
            )
        if candidates:
            names = ", ".join(p.name for _, p in candidates)
            raise CheckpointError(
                f"no usable checkpoint in {self.paths.checkpoints} ({names} all failed to load); "
                "refusing to start over: move them away or choose a new run.name"
            )
        return None

    def judge_summary(self, config_of: Any, shapes: dict[str, Shape]) -> str:
        """Pruning's verdict from an entry's cheap summary (rule 5 only): "" when it is this run's."""
        try:
            for accept in self.accept:
                accept({"config": config_of, "model_shapes": shapes})
        except ValueError as exc:
            return str(exc)
        return ""


def backend_of(paths: RunPaths, preferred: Backend | None = None) -> Backend:
    """The backend whose checkpoints ``paths`` holds (``preferred`` when it holds none, or both)."""
    if preferred is not None and preferred.candidates(paths):
        return preferred
    return next((b for b in BACKENDS if b.candidates(paths)), preferred or BACKENDS[0])


def foreign_kind(paths: RunPaths, ours: Backend) -> str | None:
    """Why a run whose checkpoints are ``ours`` cannot resume ``paths``: it holds another backend's. A run
    keeps the format it started with: files and folders of shards are not converted. The strategy to launch
    with is the one the found checkpoint's own config records."""
    for other in BACKENDS:
        if other is not ours and type(other) is not type(ours):
            found = other.candidates(paths)
            if found:
                strategy = _strategy_of(other, found[0][1], paths.shared)
                return (
                    f"run directory {paths.root} holds dist.strategy={strategy} checkpoints ({other.kind}: "
                    f"{found[0][1].name}); a run keeps its strategy: launch with dist.strategy={strategy} to resume it, "
                    "or choose another run.name"
                )
    return None


def _strategy_of(backend: Backend, path: Path, shared: bool) -> str:
    """The ``dist.strategy`` a trusted checkpoint's recorded config names ("?" where it cannot be read)."""
    try:
        backend.trust(path, shared)
        config = backend.summary(path)[1]
        return str(config["dist"]["strategy"])
    except Exception:  # a damaged record: the message still names the format
        return "?"


def _say_owner(path: Path) -> None:
    """A team run (``run.shared``) may resume a teammate's checkpoint: say whose, so it is never a surprise."""
    import pwd

    uid = path.lstat().st_uid
    if uid != os.geteuid():
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = "an unknown user"
        log.warning("resuming from %s, written by %s (uid %d), not by you (run.shared)", path, name, uid)


# The ``accept`` rules: each raises ValueError naming why a record is not the caller's.


def _shapes(record: dict[str, Any]) -> dict[str, Shape]:
    if "model_shapes" in record:
        return {k: tuple(v) for k, v in record["model_shapes"].items()}
    return {k: tuple(v.shape) for k, v in record["model"].items() if isinstance(v, torch.Tensor)}


def require(*keys: str) -> Accept:
    """The record must hold each of ``keys`` (``"optimizer"``, ``"rng"``)."""

    def accept(record: dict[str, Any]) -> None:
        missing = [k for k in keys if k not in record]
        if missing:
            raise ValueError(f"no {', '.join(map(repr, missing))} in it")

    return accept


def same_model(reference: dict[str, Any]) -> Accept:
    """The checkpoint's model has exactly the keys and tensor shapes of ``reference`` (a state dict, the
    fresh model's on the meta device, or ``{name: shape}``)."""
    want = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for k, v in reference.items()}

    def accept(record: dict[str, Any]) -> None:
        got = _shapes(record)
        if got.keys() != want.keys():
            extra, lost = sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys())
            raise ValueError(f"another model (keys only there: {extra[:3]}, keys missing: {lost[:3]})")
        for k, shape in want.items():
            if got[k] != shape:
                raise ValueError(f"another model ({k} has shape {list(got[k])}, this model {list(shape)})")

    return accept


def same_config(cfg: Any) -> Accept:
    """The checkpoint's own config may differ from ``cfg`` only where a relaunch may; nothing is imported
    to tell (``config.changes_from``: a checkpoint naming another task is another run, its file unread)."""
    from ddp_slurm import config

    def accept(record: dict[str, Any]) -> None:
        saved = record.get("config")
        if not isinstance(saved, dict):
            raise ValueError("it records no config")
        try:
            diffs = config.changes_from(saved, cfg, "the checkpoint")
        except config.ConfigError as exc:
            raise ValueError(f"its config is not valid here ({exc})") from None
        if diffs:
            raise ValueError(f"written by a run with another config ({'; '.join(diffs)})")

    return accept


def all_of(*checks: Accept) -> Accept:
    """Several ``accept`` rules as one, run in order."""

    def accept(record: dict[str, Any]) -> None:
        for check in checks:
            check(record)

    return accept


def latest(run_dir: Path, accept: Accept | None = None, shared: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of ``run_dir`` that is trusted, whole and in place (and passes ``accept``),
    whichever backend wrote it; None where there is none. For readers that only want the state (tools,
    ``checkpoint.load_latest``); a resume adds the run's own rules (``Checkpointer.find``)."""
    paths = RunPaths(Path(run_dir), shared)
    gate = Gate(backend_of(paths), paths, [accept] if accept else [], resumable=False)
    return gate.newest()
