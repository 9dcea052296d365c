"""What every logger takes from a record and from the config: the numeric fields, the flat config."""

from __future__ import annotations

from typing import Any

from ddp_slurm.config import Config


def numeric(fields: dict[str, Any]) -> dict[str, float]:
    """The fields of a record that are numbers (a bool is a flag, not a metric)."""
    return {k: float(v) for k, v in fields.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as ``{"train.lr": 0.1, ..., "task": "..."}``: a logger's params."""
    flat: dict[str, Any] = {"task": cfg.task}
    for section, body in cfg.to_dict().items():
        if section != "task":
            flat.update({f"{section}.{k}": v for k, v in body.items()})
    return flat
