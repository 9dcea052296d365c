"""A run-directory folder that a library writes into (MLflow's file store, TensorBoard's event files): ours, or refused.

MLflow and TensorBoard open their files with a plain ``open``: a symlink planted at ``<run_dir>/mlruns``,
or anywhere inside it, makes them write into whatever it points at (a co-tenant's files). How a library
opens its files is not ours to change, so the folder is checked once, when the logger opens, in the
logger's thread: created with ``safefs.make_dir`` (which refuses a symlink or a non-directory there),
trusted by ``safefs.check_trusted`` (this user's, not writable by others; by the group only with
``run.shared``), then walked without following links: a symlink, FIFO, socket or device anywhere inside
refuses it. From then on only this user (and a team run's group) can change what is inside.

A refusal is ``safefs.UnsafePath``: :class:`.guard.Guarded` makes it one warning, the logger is off and
training goes on (a logger never stops training); ``metrics.jsonl`` has every record either way.
"""

from __future__ import annotations

import os
from pathlib import Path

from ddp_slurm import safefs


def library_folder(path: Path, shared: bool = False) -> Path:
    """``path``, created if missing, once it is a folder a library may write into (see the module doc)."""
    safefs.make_dir(path, shared)
    safefs.check_trusted(path, shared, use="log into")
    folders = [path]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                elif not entry.is_file(follow_symlinks=False):
                    what = "a symlink" if entry.is_symlink() else "not a plain file or folder"
                    raise safefs.UnsafePath(
                        f"refusing to log into {path}: {entry.path} is {what}; remove it, then launch again"
                    )
    return path
