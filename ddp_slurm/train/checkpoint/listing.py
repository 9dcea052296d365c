"""The step files in a run's ``checkpoints/`` folder, and which of them are this run's own.

``list_checkpoints`` finds ``step-N.pt`` by name; ``prune`` keeps the ``checkpoint.keep`` newest of
those a resume of this run would accept and leaves everything else alone (junk under a step name,
another run's checkpoints), reading each file's step, config and model shapes memory-mapped, without
touching tensor data. The writer keeps ``prune``'s verdicts between saves (``seen``), so each kept
file is read once, not at every save.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from ddp_slurm.runpaths import RunPaths

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return RunPaths(run_dir).checkpoints


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-N.pt``, newest first."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def _summary(path: Path) -> tuple[int, Any, dict[str, tuple[int, ...]]]:
    """(step, recorded config, model shapes) of a checkpoint file, read cheaply (memory-mapped, no tensor
    data touched); ValueError when it does not load as a checkpoint at all."""
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


def identity(state: dict[str, Any]) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """(recorded config, model shapes): what makes a checkpoint one of this run's (``_foreign``)."""
    shapes = {k: tuple(v.shape) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    return state.get("config"), shapes


def _foreign(config_of: Any, shapes: dict[str, tuple[int, ...]], ours: tuple[Any, Any]) -> str | None:
    """Why a checkpoint is not one that a resume of the run that wrote ``ours`` (config, shapes) would
    accept (``same_config``, ``same_model``), or None."""
    from ddp_slurm import config

    our_config, our_shapes = ours
    if shapes != our_shapes:
        return "it holds another model"
    if isinstance(our_config, dict):
        if not isinstance(config_of, dict):
            return "it records no config"
        try:
            diffs = config.incompatible_changes(
                config.from_dict(config_of, "the checkpoint"), config.from_dict(our_config, "the run")
            )
        except config.ConfigError:
            return "its config is not valid here"
        if diffs:
            return f"written by a run with another config ({'; '.join(diffs)})"
    return None


def prune(
    run_dir: Path,
    keep: int,
    newest: Path | None = None,
    *,
    ours: tuple[Any, Any] | None = None,
    seen: dict[Any, Any] | None = None,
) -> None:
    """Delete all but the ``keep`` newest checkpoints, ranked by the step *inside* each file.

    Only files that a resume of this run would accept are counted or deleted: they load as checkpoints,
    their in-file step matches their name, and their config and model are those of ``newest`` (the file
    just written: this run's; ``ours``, its (config, model shapes), when the caller has them). A junk
    ``step-999999999.pt`` (another tool's file, a half-finished copy) or another run's valid checkpoint
    with a higher step would otherwise take a slot and get this run's checkpoints deleted. Such files
    are left alone with a warning. ``newest`` is never deleted, and never read when the caller gives
    ``ours``: it has just written that file from that state. (The seal is not read here: that would
    read every kept file in full at each save.) ``seen``: verdicts of earlier calls, by file identity
    (inode, size, modification time) and ``ours``, so that a writer saving every few seconds never
    reads back what it wrote, and reads a file that came another way once, not at every save.
    """
    written = newest if ours is not None else None  # reading it back costs more than writing it did
    if ours is None and newest is not None:
        try:
            _, config_of, shapes = _summary(newest)
            ours = (config_of, shapes)
        except ValueError:
            ours = None
    mine = repr(ours)
    trusted: list[tuple[int, Path]] = []
    for step, path in list_checkpoints(run_dir):
        try:
            st = path.stat()
        except OSError:
            continue  # removed meanwhile
        key = (path, st.st_ino, st.st_size, st.st_mtime_ns, mine)
        if path == written:
            why = ""  # written from ``ours`` a moment ago: this run's by construction
        elif seen is not None and key in seen:
            why = seen[key]
        else:
            why = _judge(path, step, ours, newest)
            if why:
                log.warning("leaving %s alone (not counted for checkpoint.keep): %s", path, why)
        if seen is not None:
            seen[key] = why
        if not why:
            trusted.append((step, path))
    trusted.sort(key=lambda item: (item[1] == newest, item[0]), reverse=True)
    for _, old in trusted[keep:]:
        old.unlink(missing_ok=True)
        if seen is not None:
            for key in [k for k in seen if k[0] == old]:
                del seen[key]


def _judge(path: Path, step: int, ours: tuple[Any, Any] | None, newest: Path | None) -> str:
    """Why ``prune`` must leave ``path`` alone, or "" when it is one of this run's checkpoints."""
    try:
        inside, config_of, shapes = _summary(path)
    except ValueError as exc:
        return str(exc)
    if inside != step:
        return f"it holds step {inside}"
    return (_foreign(config_of, shapes, ours) if ours is not None and path != newest else None) or ""
