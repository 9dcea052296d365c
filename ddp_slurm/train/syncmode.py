"""``DDP_SLURM_SYNC_DEBUG``: its name and its one check, torch-free, for the hook that watches the steps
(``hooks/syncdebug.py``) and for the start-up checks that refuse what it would catch (``precision.py``)."""

from __future__ import annotations

from collections.abc import Mapping

from ddp_slurm import errors

ENV = "DDP_SLURM_SYNC_DEBUG"
MODES = ("warn", "error")


def mode_from(environ: Mapping[str, str]) -> str | None:
    """The mode ``DDP_SLURM_SYNC_DEBUG`` asks for (None: unset or empty); UsageError in one line naming the
    value and the accepted ones otherwise. The one check of the variable: start-up calls it before anything
    is created."""
    mode = environ.get(ENV) or None
    if mode is not None and mode not in MODES:
        raise errors.UsageError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)} (or unset)")
    return mode
