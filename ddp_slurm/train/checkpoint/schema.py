"""The shape of a checkpoint record, checked before anything of it is used, for every backend.

A checkpoint can pass its seal and still hold garbage: written by another program or version, or
forged and re-sealed with this program's own functions (the seal is a checksum anyone can recompute).
Every value a resume reads is checked here first, with one rule for the whole file and the folder of
shards alike: counts are non-negative integers (not booleans), the step in the epoch is not beyond
the step, the time is finite, the best metric a number or null (its step, and the step last
evaluated, not beyond the step; early stopping's count a count), the flags booleans, the RNG streams
one per rank and each a stream, the schedule, task state and config mappings. A record that fails is
skipped like a corrupt file (``ValueError`` naming the key), so a resume falls back to the checkpoint
before it instead of resuming somewhere else or crashing on every requeue.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddp_slurm import skips


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _time(value: Any) -> bool:
    return _number(value) and value >= 0


def _mapping(value: Any) -> bool:
    return isinstance(value, dict)


def _config(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("task"), str)


# key -> (check, what it must be); every resumable record holds these, whatever its backend
RESUMABLE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (_count, "a count"),
    "epoch": (_count, "a count"),
    "step_in_epoch": (_count, "a count"),
    "finished": (lambda v: isinstance(v, bool), "true or false"),
    "elapsed_s": (_time, "a time"),
    "best": (lambda v: v is None or _number(v), "a number or null"),
    "scheduler": (_mapping, "a mapping"),
    "task": (_mapping, "a mapping"),
    "config": (_config, "a config mapping naming its task"),
    "rng": (lambda v: isinstance(v, list) and bool(v), "a list of every rank's streams"),
}


def _scaler(value: Any) -> bool:
    """None, or a gradient scaler's state as ``torch.amp.GradScaler.state_dict`` makes it (fp16)."""
    if value is None:
        return True
    if not isinstance(value, dict) or set(value) != {
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
    }:
        return False
    return (
        all(_number(value[k]) and value[k] > 0 for k in ("scale", "growth_factor", "backoff_factor"))
        and _count(value["growth_interval"])
        and value["growth_interval"] > 0
        and _count(value["_growth_tracker"])
    )


def _guard(value: Any) -> bool:
    """The guard's state as ``guard.state`` writes it: empty, or its statistics, skipped steps and rollbacks."""
    if not isinstance(value, dict):
        return False
    if not value:
        return True
    mean = value.get("mean")
    return (
        set(value) == {"mean", "dev", "seen", "skips", "rollbacks"}
        and (mean is None or _number(mean))
        and _number(value["dev"])
        and value["dev"] >= 0
        and _count(value["seen"])
        and _count(value["rollbacks"])
        and skips.valid(value["skips"])
    )


# key -> (check, what it must be); checked where a record holds it (checkpoints made before it existed do not)
OPTIONAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "scaler": (_scaler, "null or a gradient scaler's state"),
    "best_step": (lambda v: v is None or _count(v), "a count or null"),
    "stale": (_count, "a count"),
    "evaluated": (_count, "a count"),
    "guard": (_guard, "the guard's state (loss statistics, skipped steps, rollbacks)"),
}


def check(record: Mapping[str, Any], extra: Mapping[str, tuple[Callable[[Any], bool], str]] = {}) -> None:
    """ValueError naming the first key of ``record`` that a resume could not use (``extra``: the backend's
    own keys, checked the same way; ``OPTIONAL`` keys where present)."""
    for key, (ok, what) in {**RESUMABLE, **extra}.items():
        if key not in record:
            raise ValueError(f"no {key!r} in it")
        if not ok(record[key]):
            raise ValueError(f"its {key} is not {what} ({record[key]!r:.40})")
    for key, (ok, what) in OPTIONAL.items():
        if key in record and not ok(record[key]):
            raise ValueError(f"its {key} is not {what} ({record[key]!r:.40})")
    for key in ("best_step", "evaluated"):
        if (record.get(key) or 0) > record["step"]:
            raise ValueError(f"its {key} {record[key]} is beyond its step {record['step']}")
    if record["step_in_epoch"] > record["step"]:
        raise ValueError(f"its step_in_epoch {record['step_in_epoch']} is beyond its step {record['step']}")
    world = record.get("world_size")
    if world is not None and (not _count(world) or world != len(record["rng"])):
        raise ValueError(f"its world_size {world!r:.20} does not match its {len(record['rng'])} RNG streams")
    rng_streams(record["rng"])


def rng_streams(rngs: list[Any]) -> None:
    """ValueError unless each entry is one rank's streams as ``rng.rng_state`` makes them."""
    torch_size = torch.get_rng_state().numel()
    for rank, rng in enumerate(rngs):
        where = f"its RNG streams of rank {rank}"
        if not isinstance(rng, dict):
            raise ValueError(f"{where} are not a mapping")
        py = rng.get("python")
        if not (isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], tuple) and len(py[1]) == 625):
            raise ValueError(f"{where}: the python state is not one")
        t = rng.get("torch")
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.numel() == torch_size):
            raise ValueError(f"{where}: the torch state is not one")
        np_state = rng.get("numpy")
        if np_state is not None and not (
            isinstance(np_state, list)
            and len(np_state) == 5
            and isinstance(np_state[1], torch.Tensor)
            and np_state[1].numel() == 624
        ):
            raise ValueError(f"{where}: the numpy state is not one")
        cuda = rng.get("cuda")
        if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8):
            raise ValueError(f"{where}: the CUDA state is not one")


def shapes(value: Any) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` from a record's ``model_shapes``; ValueError unless names map to lists of counts."""
    if not isinstance(value, dict) or not value:
        raise ValueError("its model_shapes is not a mapping of tensor shapes")
    out = {}
    for name, shape in value.items():
        if not isinstance(name, str) or not isinstance(shape, (list, tuple)) or not all(_count(d) for d in shape):
            raise ValueError(f"its model_shapes entry {name!r:.40} is not a tensor shape")
        out[name] = tuple(shape)
    return out
