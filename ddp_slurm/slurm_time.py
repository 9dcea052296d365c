"""Slurm's time-limit syntax (``sbatch --time``), read into minutes and written back.

Slurm accepts ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM`` and ``D-HH:MM:SS``; ``UNLIMITED``
and ``INFINITE`` mean no limit. Seconds round up to the next minute, as Slurm itself does.
Imports nothing heavy: the config checks and the launchers use it.
"""

from __future__ import annotations

import math
import re

FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
UNLIMITED = ("UNLIMITED", "INFINITE")

_DAYS = re.compile(r"^(\d+)-(\d+)(?::(\d+))?(?::(\d+))?$")
_CLOCK = re.compile(r"^(\d+)(?::(\d+))?(?::(\d+))?$")


def minutes(text: str | int) -> int | None:
    """``"1-02:30"`` -> 1590; ``"90"`` -> 90; ``"UNLIMITED"`` -> None. Raises ValueError naming the formats."""
    raw = str(text).strip()
    if raw.upper() in UNLIMITED:
        return None
    days = _DAYS.match(raw)
    if days:
        d, h, m, s = (int(g or 0) for g in days.groups())
        total = ((d * 24 + h) * 60 + m) * 60 + s
    else:
        clock = _CLOCK.match(raw)
        if not clock:
            raise ValueError(f"{raw!r} is not a Slurm time ({FORMATS})")
        parts = [int(g) for g in clock.groups() if g is not None]
        if len(parts) == 1:  # MM
            total = parts[0] * 60
        elif len(parts) == 2:  # MM:SS
            total = parts[0] * 60 + parts[1]
        else:  # HH:MM:SS
            total = (parts[0] * 60 + parts[1]) * 60 + parts[2]
    if total <= 0:
        raise ValueError(f"{raw!r} is no time at all: give at least one minute ({FORMATS})")
    return math.ceil(total / 60)


def format_minutes(total: int | None) -> str:
    """1590 -> ``"1-02:30:00"``, 90 -> ``"01:30:00"``, None -> ``"UNLIMITED"`` (what scontrol prints)."""
    if total is None:
        return "UNLIMITED"
    d, rest = divmod(total, 24 * 60)
    h, m = divmod(rest, 60)
    return f"{d}-{h:02d}:{m:02d}:00" if d else f"{h:02d}:{m:02d}:00"
