"""The parts every run's checkpoint holds (``parts.py``), and the checks of their values.

- ``Place``: where training stands (``state.Position``: step, epoch, step in epoch, the best metric, its
  step, early stopping's count, the step last evaluated), with whether the run finished and its time;
- ``Schedule``: the learning-rate schedule; ``Scaler``: fp16's gradient scaler (None without one);
- ``TaskState``: the task's own ``state_dict``;
- ``Streams``: every rank's RNG streams (``rng.py``), one per rank; at another world size, ranks without a
  counterpart start fresh streams seeded from ``(seed, rank, step)``, with one warning;
- ``GuardState``: the guard's loss statistics, skipped steps and rollbacks (``guard/``);
- ``RunRecord``: the run's config (only a config this run may resume counts as its own), the restart count
  and the world size it was saved at.

On-disk keys are this release's earliest names: a checkpoint of any earlier version resumes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ddp_slurm import skips
from ddp_slurm.train import rng
from ddp_slurm.train.checkpoint.parts import Moment, Part, Parts, Restoring

log = logging.getLogger("ddp_slurm")


def count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def mapping(value: Any) -> bool:
    return isinstance(value, dict)


COUNT = (count, "a count")
MAPPING = (mapping, "a mapping")


class Place(Part):
    keys = {
        "step": COUNT,
        "epoch": COUNT,
        "step_in_epoch": COUNT,
        "finished": (lambda v: isinstance(v, bool), "true or false"),
        "elapsed_s": (lambda v: number(v) and v >= 0, "a time"),
        "best": (lambda v: v is None or number(v), "a number or null"),
    }
    optional = {  # checkpoints of earlier versions: the best's step unknown, no early-stopping count
        "best_step": (lambda v: v is None or count(v), "a count or null"),
        "stale": COUNT,
        "evaluated": COUNT,
    }

    def __init__(self, run: Any) -> None:
        self.run = run

    def take(self, now: Moment) -> dict[str, Any]:
        pos = self.run.pos
        return {
            "step": pos.step,
            "epoch": pos.epoch,
            "step_in_epoch": pos.step_in_epoch,
            "finished": now.finished,
            "elapsed_s": now.elapsed_s,
            "best": pos.best,
            "best_step": pos.best_step,
            "stale": pos.stale,
            "evaluated": pos.evaluated,
        }

    def put(self, saved: dict[str, Any], how: Restoring) -> None:
        pos = self.run.pos  # in place: the loop and the hooks hold this object
        pos.step, pos.epoch, pos.step_in_epoch = saved["step"], saved["epoch"], saved["step_in_epoch"]
        pos.elapsed_s, pos.best = saved["elapsed_s"], saved["best"]
        pos.best_step, pos.stale = saved.get("best_step"), saved.get("stale", 0)
        pos.evaluated = saved.get("evaluated", saved["step"])  # nothing to redo


class Schedule(Part):
    keys = {"scheduler": MAPPING}

    def __init__(self, run: Any) -> None:
        self.run = run

    def take(self, now: Moment) -> dict[str, Any]:
        return {"scheduler": self.run.scheduler.state_dict()}

    def put(self, saved: dict[str, Any], how: Restoring) -> None:
        self.run.scheduler.load_state_dict(saved["scheduler"])


def scaler_state(value: Any) -> bool:
    """None, or a gradient scaler's state as ``torch.amp.GradScaler.state_dict`` makes it (fp16)."""
    if value is None:
        return True
    names = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    if not isinstance(value, dict) or set(value) != names:
        return False
    return (
        all(number(value[k]) and value[k] > 0 for k in ("scale", "growth_factor", "backoff_factor"))
        and count(value["growth_interval"])
        and value["growth_interval"] > 0
        and count(value["_growth_tracker"])
    )


class Scaler(Part):
    optional = {"scaler": (scaler_state, "null or a gradient scaler's state")}

    def __init__(self, run: Any) -> None:
        self.scaler = getattr(run, "scaler", None)  # a benchmark's stand-in for a run has none

    def take(self, now: Moment) -> dict[str, Any]:
        return {"scaler": None if self.scaler is None else self.scaler.state_dict()}

    def put(self, saved: dict[str, Any], how: Restoring) -> None:
        if self.scaler is not None and saved.get("scaler"):  # the same precision: the run's config says so
            self.scaler.load_state_dict(saved["scaler"])


class TaskState(Part):
    keys = {"task": MAPPING}

    def __init__(self, run: Any) -> None:
        self.run = run

    def take(self, now: Moment) -> dict[str, Any]:
        return {"task": self.run.task.state_dict()}

    def put(self, saved: dict[str, Any], how: Restoring) -> None:
        self.run.task.load_state_dict(saved["task"])


class Streams(Part):
    keys = {"rng": (lambda v: isinstance(v, list) and bool(v), "a list of every rank's streams")}
    per_rank = True

    def __init__(self, run: Any) -> None:
        self.run = run

    def take(self, now: Moment) -> dict[str, Any]:
        return {"rng": rng.rng_state(self.run.device)}

    def put(self, saved: dict[str, Any], how: Restoring) -> None:
        streams = saved["rng"]
        if len(streams) == how.world_size:
            rng.set_rng_state(streams[how.rank], how.device)
            return
        rng.seed_rank(how.seed, how.rank, self.run.pos.step, how.device)  # Place is put back before
        if how.rank == 0:
            log.warning(
                "resuming at world size %d from %s of world size %d: %s",
                how.world_size,
                how.what,
                len(streams),
                how.changed,
            )


def guard_state(value: Any) -> bool:
    """The guard's state as ``guard/`` writes it: empty, or its statistics, skipped steps and rollbacks."""
    if not isinstance(value, dict):
        return False
    if not value:
        return True
    mean, samples = value.get("mean"), value.get("samples", [])
    return (
        set(value) - {"samples"} == {"mean", "dev", "seen", "skips", "rollbacks"}  # samples: since bad samples
        and isinstance(samples, list)
        and all(isinstance(p, list) and len(p) == 2 and all(count(v) for v in p) for p in samples)
        and (mean is None or number(mean))
        and number(value["dev"])
        and value["dev"] >= 0
        and count(value["seen"])
        and count(value["rollbacks"])
        and skips.valid(value["skips"])
    )


class GuardState(Part):
    """The guard's state (``guard/``): its loss's running mean and deviation and how many steps fed them, the
    skipped steps, the rollbacks made. Empty until the guard writes it; the guard reads and writes ``value``."""

    optional = {"guard": (guard_state, "the guard's state (loss statistics, skipped steps, rollbacks)")}

    def __init__(self) -> None:
        self.value: dict[str, Any] = {}

    def take(self, now: Moment) -> dict[str, Any]:
        return {"guard": dict(self.value)}

    def put(self, saved: dict[str, Any], how: Restoring) -> None:
        self.value = dict(saved.get("guard") or {})


class RunRecord(Part):
    """The run's config, restart count and world size, recorded; nothing to put back (the gate compares the
    config; a stand-in run without a config, a benchmark's, passes it in ``extra``)."""

    keys = {
        "config": (lambda v: isinstance(v, dict) and isinstance(v.get("task"), str), "a config mapping naming its task")
    }
    optional = {"restart_count": COUNT, "world_size": COUNT}

    def __init__(self, run: Any) -> None:
        self.run = run

    def take(self, now: Moment) -> dict[str, Any]:
        run, out = self.run, {"world_size": self.run.world_size}
        if getattr(run, "cfg", None) is not None:
            out["config"] = run.cfg.to_dict()
        if getattr(run, "env", None) is not None:
            out["restart_count"] = run.env.restart_count
        return out

    def put(self, saved: dict[str, Any], how: Restoring) -> None:
        pass


KINDS: tuple[type[Part], ...] = (Place, Schedule, Scaler, TaskState, Streams, GuardState, RunRecord)
"""The standard parts, in the order they are put back (``Streams`` after ``Place``: a fresh stream is seeded
from the step)."""


def standard(run: Any) -> Parts:
    """The standard parts of ``run`` (its objects: ``backends.Objects``)."""
    return Parts([kind() if kind is GuardState else kind(run) for kind in KINDS])


def parts_of(run: Any) -> Parts:
    """The run's registered parts; a stand-in run without them (a test's, a benchmark's) gets the standard ones."""
    parts = getattr(run, "parts", None)
    return parts if parts is not None else standard(run)
