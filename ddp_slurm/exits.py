"""How the local launcher learns that its workers stopped cleanly after it was interrupted (Ctrl-C).

Why: on SIGINT torchrun's agent raises an exception in itself, passes SIGINT on to its workers, waits
for them and then forgets how they ended; the launcher would only know "interrupted" (exit 130),
although the workers wrote a checkpoint and exited 75 ("launch again to resume"). So the launcher
names a folder in ``DDP_SLURM_EXIT_DIR`` before torchrun starts the workers (they inherit it); each
training process writes ``<pid>`` there when it starts (``started``) and overwrites it with its exit
code when it leaves (``record``). A worker killed before it could write its code leaves ``started``.
Outside the launcher the variable is unset and nothing is written.

At the package's top, not under ``launch/``: training writes the record and the launcher reads it, and
training never imports the launchers that sit above it.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "DDP_SLURM_EXIT_DIR"


def _own_file() -> Path | None:
    folder = os.environ.get(ENV)
    return Path(folder, str(os.getpid())) if folder else None


def started() -> None:
    """A worker: note that this process runs (its code follows at exit)."""
    path = _own_file()
    if path is not None:
        try:
            path.write_text("started")
        except OSError:  # the launcher's folder is gone: it only loses the exit-75 pass-through
            pass


def record(code: int) -> None:
    """A worker, leaving: its exit code for the launcher."""
    path = _own_file()
    if path is not None:
        try:
            path.write_text(str(int(code)))
        except OSError:
            pass


def codes(folder: Path) -> list[str]:
    """The launcher: what each worker wrote (an exit code, or ``started`` for one that did not finish)."""
    return [p.read_text().strip() for p in sorted(folder.iterdir())] if folder.is_dir() else []


def all_stopped(folder: Path, expected: int | None, stopped: int) -> bool:
    """True when every worker (``expected`` of them, where the launcher knows the count) exited ``stopped``."""
    found = codes(folder)
    return bool(found) and all(c == str(stopped) for c in found) and (expected is None or len(found) == expected)
