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

from collections.abc import Mapping
from typing import Any

import torch

from ddp_slurm.train.checkpoint.parts import Check, check_values
from ddp_slurm.train.checkpoint.standard import KINDS, count

# key -> (check, what it must be): every resumable record holds these, whatever its backend; and the keys
# checked where a record holds them (checkpoints made before them do not). Both from the standard parts.
RESUMABLE: dict[str, Check] = {k: c for kind in KINDS for k, c in kind.keys.items()}
OPTIONAL: dict[str, Check] = {k: c for kind in KINDS for k, c in kind.optional.items()}


def check(
    record: Mapping[str, Any],
    extra: Mapping[str, Check] = {},
    parts: tuple[Mapping[str, Check], Mapping[str, Check]] | None = None,
) -> None:
    """ValueError naming the first key of ``record`` that a resume could not use (``extra``: the backend's
    own keys, checked the same way; optional keys where present). ``parts``: the run's registered parts'
    (required, optional) checks, where a run has more than the standard ones."""
    required, optional = parts if parts is not None else (RESUMABLE, OPTIONAL)
    for key in {**required, **extra}:
        if key not in record:
            raise ValueError(f"no {key!r} in it")
    check_values(record, {**required, **extra, **optional})
    for key in ("best_step", "evaluated"):
        if (record.get(key) or 0) > record["step"]:
            raise ValueError(f"its {key} {record[key]} is beyond its step {record['step']}")
    if record["step_in_epoch"] > record["step"]:
        raise ValueError(f"its step_in_epoch {record['step_in_epoch']} is beyond its step {record['step']}")
    world = record.get("world_size")
    if world is not None and (not count(world) or world != len(record["rng"])):
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
        if not isinstance(name, str) or not isinstance(shape, (list, tuple)) or not all(count(d) for d in shape):
            raise ValueError(f"its model_shapes entry {name!r:.40} is not a tensor shape")
        out[name] = tuple(shape)
    return out
