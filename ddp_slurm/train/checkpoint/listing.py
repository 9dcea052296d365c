"""The step files in a run's ``checkpoints/`` folder, and pruning to the newest of this run's own.

``list_checkpoints`` finds ``step-N.pt`` by name (the folders of shards: ``sharded.list_sharded``);
``prune`` keeps the ``checkpoint.keep`` newest of those a resume of this run would accept and leaves
everything else alone (junk under a step name, another run's checkpoints), for either backend: it judges
each entry by its backend's cheap ``summary`` (step, config, model shapes; a file is read memory-mapped,
without touching tensor data; a folder by its small commit record) against the run's own config and
shapes. The writer keeps ``prune``'s verdicts between saves (``seen``), so each kept entry is read once,
not at every save.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ddp_slurm.runpaths import RunPaths

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d+)\.pt$")

Shape = tuple[int, ...]
# Why an entry is not one of this run's checkpoints (or "" when it is), from its (config, shapes).
Judge = Callable[[Any, dict[str, Shape]], str]


def checkpoint_dir(run_dir: Path) -> Path:
    return RunPaths(run_dir).checkpoints


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-N.pt``, newest first."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def summary(path: Path) -> tuple[int, Any, dict[str, Shape]]:
    """(step, recorded config, model shapes) of a checkpoint file, read cheaply (memory-mapped, no tensor
    data touched); ValueError when it does not load as a checkpoint at all."""
    if not path.is_file() or path.is_symlink():
        raise ValueError("not a plain file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise ValueError(f"unreadable ({type(exc).__name__})") from None
    if (
        not isinstance(state, dict)
        or not isinstance(state.get("step"), int)
        or not isinstance(state.get("model"), dict)
    ):
        raise ValueError("not a checkpoint of this program")
    return state["step"], *identity(state)


def identity(state: dict[str, Any]) -> tuple[Any, dict[str, Shape]]:
    """(recorded config, model shapes): what makes a checkpoint file one of this run's."""
    shapes = {k: tuple(v.shape) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    return state.get("config"), shapes


def same_as(ours: tuple[Any, dict[str, Shape]]) -> Judge:
    """A judge for ``prune`` from the (config, shapes) of a checkpoint this run just wrote: another entry is
    this run's when its model has those shapes and its config may be resumed by the same run."""
    from ddp_slurm import config

    our_config, our_shapes = ours
    reference = None
    if isinstance(our_config, dict):
        try:
            reference = config.from_dict(our_config, "the run")
        except config.ConfigError:
            reference = None

    def judge(config_of: Any, shapes: dict[str, Shape]) -> str:
        if shapes != our_shapes:
            return "it holds another model"
        if reference is None:
            return ""
        if not isinstance(config_of, dict):
            return "it records no config"
        try:
            diffs = config.changes_from(config_of, reference, "the checkpoint")
        except config.ConfigError:
            return "its config is not valid here"
        return f"written by a run with another config ({'; '.join(diffs)})" if diffs else ""

    return judge


def prune(
    candidates: list[tuple[int, Path]],
    keep: int,
    newest: Path,
    *,
    summary_of: Callable[[Path], tuple[int, Any, dict[str, Shape]]],
    judge: Judge,
    remove: Callable[[Path], None],
    seen: dict[Any, Any] | None = None,
    spare: Iterable[Path] = (),
) -> None:
    """Delete all but the ``keep`` newest of ``candidates`` (``(step, path)`` by name), ranked by the step
    each holds, counting only this run's: those whose ``summary_of`` reads, whose step is their name's,
    and whom ``judge`` calls this run's. A junk ``step-999999999.pt`` (another tool's file, a half-finished
    copy) or another run's valid checkpoint with a higher step would otherwise take a slot and get this
    run's checkpoints deleted; such entries are left alone with a warning. ``newest`` (just written by this
    run, from the run's own state) is never read and never deleted. ``seen``: verdicts of earlier calls,
    by entry identity (inode, size, modification time), so a writer saving every few seconds reads an
    entry that came another way once, not at every save. ``spare``: the run's best checkpoint (``best.py``) and
    the guard's rollback target, kept beside the ``keep`` newest and not counted among them."""
    spare = set(spare)
    trusted: list[tuple[int, Path]] = []
    for step, path in candidates:
        try:
            st = path.lstat()
        except OSError:
            continue  # removed meanwhile
        key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
        if path == newest:
            why = ""
        elif seen is not None and key in seen:
            why = seen[key]
        else:
            try:
                inside, config_of, shapes = summary_of(path)
                why = f"it holds step {inside}" if inside != step else judge(config_of, shapes)
            except ValueError as exc:
                why = str(exc)
            if why:
                log.warning("leaving %s alone (not counted for checkpoint.keep): %s", path, why)
        if seen is not None:
            seen[key] = why
        if not why and (path not in spare or path == newest):
            trusted.append((step, path))
    trusted.sort(key=lambda item: (item[1] == newest, item[0]), reverse=True)
    for _, old in trusted[keep:]:
        remove(old)
        if seen is not None:
            for key in [k for k in seen if k[0] == old]:
                del seen[key]
