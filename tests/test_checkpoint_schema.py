"""The shape of a checkpoint record (``train/checkpoint/schema.py``): every value a resume reads is checked
first, one rule for both backends; each bad value is named."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from ddp_slurm.train import rng
from ddp_slurm.train.checkpoint import schema


def good() -> dict[str, Any]:
    return {
        "step": 12,
        "epoch": 1,
        "step_in_epoch": 2,
        "finished": False,
        "elapsed_s": 3.5,
        "best": 0.9,
        "scheduler": {},
        "task": {},
        "config": {"task": "ddp_slurm.tasks.mnist:MNIST"},
        "rng": [rng.rng_state(torch.device("cpu"))],
        "world_size": 1,
        "best_step": 10,
        "stale": 1,
        "evaluated": 12,
    }


BAD = {
    "epoch": [-3, 1.5, True, "1", None],
    "step": [-1, "12"],
    "step_in_epoch": [-1, 13],
    "finished": ["yes", 1, None],
    "elapsed_s": [float("nan"), float("inf"), -1.0, "soon"],
    "best": [float("nan"), "0.9", True],
    "scheduler": [None, [1]],
    "task": [None, "state"],
    "config": [None, {"train": {}}, {"task": 3}],
    "rng": [[], None, [{}], [{"python": random.getstate(), "torch": torch.zeros(3, dtype=torch.uint8)}]],
    "world_size": [2, -1, "1"],
    "best_step": [-1, 13, 1.0, True, "10"],  # never beyond the step
    "stale": [None, -1, 0.5, False],
    "evaluated": [None, -1, 13, "12"],
}


@pytest.mark.parametrize("key, value", [(k, v) for k, values in BAD.items() for v in values])
def test_every_bad_value_is_named(key: str, value: Any) -> None:
    record = good()
    record[key] = value
    with pytest.raises(ValueError, match="step_in_epoch|world_size|RNG|" + key):
        schema.check(record)


@pytest.mark.parametrize("key", [k for k in good() if k != "world_size" and k not in schema.OPTIONAL])
def test_every_missing_key_is_named(key: str) -> None:
    record = good()
    del record[key]
    with pytest.raises(ValueError, match=f"no '{key}' in it"):
        schema.check(record)


def test_a_good_record_passes_and_a_backend_adds_its_own_keys() -> None:
    schema.check(good())
    with pytest.raises(ValueError, match="no 'model_shapes'"):
        schema.check(good(), {"model_shapes": (lambda v: isinstance(v, dict), "a mapping")})
    with pytest.raises(ValueError, match="is not a tensor shape"):
        schema.shapes({"w": [3, -1]})


@pytest.mark.parametrize(
    "value, ok",
    [
        (None, True),
        (torch.amp.GradScaler("cpu").state_dict(), True),
        ({}, False),
        ({**torch.amp.GradScaler("cpu").state_dict(), "scale": float("inf")}, False),
        ({**torch.amp.GradScaler("cpu").state_dict(), "_growth_tracker": -1}, False),
        ({**torch.amp.GradScaler("cpu").state_dict(), "extra": 1}, False),
        ("65536", False),
    ],
)
def test_the_scalers_state_is_checked_where_a_record_has_one(value: Any, ok: bool) -> None:
    """fp16's gradient scaler (``scaler``): null or GradScaler's state; a record made before it has none."""
    schema.check(good())  # no 'scaler' key: an older checkpoint
    record = good() | {"scaler": value}
    if ok:
        schema.check(record)
    else:
        with pytest.raises(ValueError, match="its scaler is not null or a gradient scaler's state"):
            schema.check(record)


def test_the_keys_of_evaluation_are_optional_for_earlier_checkpoints() -> None:
    """A record written before ``best_step``, ``stale`` and ``evaluated`` existed passes, and resumes with
    no early-stopping count and nothing left to evaluate; ``best_step`` null is the best's step unknown."""
    record = {k: v for k, v in good().items() if k not in schema.OPTIONAL}
    schema.check(record)
    schema.check(good() | {"best_step": None})
