"""What may change between the launches of one run: the keys that change how it runs, not what it computes.

A relaunch (a requeue, a resubmission, a second ``python -m ddp_slurm.train`` on the same run
directory) resumes only when every other key is as the run was started with; the fields and sections
say which keys those are (``checked(..., resumable=True)``, ``RESUMABLE``), this module applies it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp_slurm.config.schema import Config, _fields, _keys
from ddp_slurm.runpaths import RunPaths


def _resumable(cfg: Config, key: str) -> bool:
    """Whether ``key`` may differ between the launches of one run (it changes how the run runs, not what
    it computes): its section says so (``RESUMABLE``) or its field does (``checked(..., resumable=True)``)."""
    section, _, name = key.partition(".")
    target = cfg.sections().get(section)
    if target is None:
        return False
    f = _fields(target).get(_keys(target).get(name, name))
    return bool(getattr(target, "RESUMABLE", False) or (f is not None and f.metadata.get("resumable")))


def incompatible_changes(old: Config, new: Config) -> list[str]:
    """Keys whose values differ in a way that would make a resumed run compute something else."""
    if old.task != new.task:
        return [f"task: {old.task!r} -> {new.task!r}"]
    a, b = _flat(old), _flat(new)
    return [f"{k}: {a[k]!r} -> {b.get(k)!r}" for k in a if a[k] != b.get(k) and not _resumable(new, k)]


def _flat(cfg: Config) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, body in cfg.to_dict().items() if s != "task" for k, v in body.items()}


def hint(run_dir: Path) -> str:
    """The two ways to relaunch with a run's own settings, for messages that refuse another config."""
    return f"`ddp-slurm resume {run_dir}` or `--config {RunPaths(run_dir).config}` reuse them"


def changed_config(run_dir: Path, diffs: list[str]) -> str:
    """The refusal of a relaunch whose config differs from the run's own in a way a resume cannot take."""
    longer = any(d.startswith(("train.epochs:", "train.max_steps:")) for d in diffs)
    extend = (
        f"; to train it longer, start a new run from its weights: run.name=NEW run.init_from={run_dir} "
        "(docs/training.md, 'Warm start')"
        if longer
        else ""
    )
    return (
        f"run directory {run_dir} holds a run with another config ({'; '.join(diffs)}): launch with the same "
        f"settings to resume it ({hint(run_dir)}), or choose another run.name{extend}"
    )
