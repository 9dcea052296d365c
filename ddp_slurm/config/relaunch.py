"""What may change between the launches of one run: the keys that change how it runs, not what it computes.

A relaunch (a requeue, a resubmission, a second ``python -m ddp_slurm.train`` on the same run
directory) resumes only when every other key is as the run was started with; the fields and sections
say which keys those are (``checked(..., resumable=True)``, ``RESUMABLE``), this module applies it.

The saved side (a run directory's config.yaml, a checkpoint's embedded config) is never imported:
``changes_from`` checks its task sections with the live config's own task class, which training has
imported already, and only when both name the same task; another task is one difference, unread.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddp_slurm import taskref
from ddp_slurm.config import loading
from ddp_slurm.config.files import _show
from ddp_slurm.config.schema import RUNTIME_SECTIONS, Config, ConfigError, _fields, _keys
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


def changes_from(saved: Mapping[str, Any], cfg: Config, where: str) -> list[str]:
    """The keys of ``saved`` (a config mapping as a run wrote it: a checkpoint's embedded config, or its
    config.yaml as parsed YAML) whose values differ from the live ``cfg``'s in a way a relaunch cannot take,
    as ``"key: old -> new"``; importing nothing. Another task is one difference (its sections unread); the
    same task's sections are checked with ``cfg``'s own task class. An invalid ``saved`` is a one-line
    ConfigError naming ``where``."""
    if not isinstance(saved, Mapping) or not saved:
        raise ConfigError(f"{where}: expected the mapping of sections this program writes, got {_show(saved)}")
    return incompatible_changes(loading.from_dict(saved, where, resolve=False), cfg)


def incompatible_changes(old: Config, new: Config) -> list[str]:
    """Keys whose values differ in a way that would make a resumed run compute something else. ``old`` may be
    unresolved (read from a run): its task sections are then checked with ``new``'s task class (ConfigError
    when they do not fit it). Where ``new`` is unresolved too (a dry run), only the runtime's keys compare."""
    if not taskref.same(old.task, new.task):  # a run recorded before files were absolute, or moved since
        return [f"task: {old.task!r} -> {new.task!r}"]
    if new.resolved:
        old = loading.checked_with(old, type(new.task_config))
    a, b = _flat(old), _flat(new)
    if not (old.resolved and new.resolved):  # the task's keys are known only through its class
        a = {k: v for k, v in a.items() if k.partition(".")[0] in RUNTIME_SECTIONS}
    return [f"{k}: {a[k]!r} -> {b.get(k)!r}" for k in a if a[k] != b.get(k) and not _resumable(new, k)]


def _flat(cfg: Config) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, body in cfg.to_dict().items() if s != "task" for k, v in body.items()}


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in ``run_dir`` with its own config and world size (resume.py)."""
    return f"ddp-slurm resume {shlex.quote(str(run_dir))}"


def hint(run_dir: Path) -> str:
    """The two ways to relaunch with a run's own settings, for messages that refuse another config."""
    return f"`{resume_command(run_dir)}` or `--config {RunPaths(run_dir).config}` reuse them"


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
