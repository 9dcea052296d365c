"""``<run dir>/guard.jsonl``: the guard's rollbacks and skipped steps, kept beside the checkpoints.

A checkpoint holds the guard's state too, but a launch stopped between a rollback and its next checkpoint
would resume from a checkpoint that predates them: the run would train the bad steps again, and a rollback
cap would count from too few. So rank 0 appends a line as each happens, and every launch takes the union
(skipped steps) and the maximum (rollbacks) of this file and the checkpoint it resumes.

Lines: ``{"event": "rollback", "step": S, "to": C, ...}`` and ``{"event": "skip", "steps": [A, B], ...}``
(with ``"bad_samples": [[index, epoch], ...]``: the samples found bad, left out from that epoch on),
appended and read back through ``safefs`` (never through a link, at most 1 MiB). A line that is not JSON was
cut short by a kill (the next append starts on a line of its own) and is passed over; JSON that is not one of
these lines is refused in one line naming the file, since what it says decides which data trains.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ddp_slurm import safefs, skips
from ddp_slurm.runpaths import RunPaths


def append(paths: RunPaths, event: str, **fields: Any) -> None:
    """Rank 0: one line for a rollback or a skip."""
    row = {"event": event, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}
    safefs.append_owned(paths.guard, json.dumps(row) + "\n", paths.shared)


def read(paths: RunPaths) -> tuple[set[int], list[tuple[int, int]]]:
    """(the steps rolled back for, skipped steps) as the file says; (set(), []) without it. A step flagged
    again after a relaunch (its rollback was cut short by a stop) is the same rollback. ``safefs.UnsafePath``
    when it is not a file this program wrote."""
    text = safefs.read_small(paths.guard) or ""
    flagged, ranges = set(), []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # not JSON at all: a line a killed writer cut short (appends end it: safefs)
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(row, dict) and row.get("event") == "rollback" and isinstance(step, int) and step >= 1:
            flagged.add(step)
        elif isinstance(row, dict) and row.get("event") == "skip" and skips.valid([row.get("steps")]):
            ranges.append(tuple(row["steps"]))
        else:  # JSON that says something else: forged or another program's, and it decides what trains
            raise safefs.UnsafePath(
                f"{paths.guard} line {number} is not a rollback or a skip this program wrote: remove that line"
            )
    return flagged, skips.merged(ranges)


def bad_samples(paths: RunPaths) -> list[list[int]]:
    """The ``[dataset index, epoch found]`` pairs the skip lines name (``culprits.py``); [] without the file. Read
    after ``read``, which refuses a file this program did not write; a pair that is not two counts is passed over."""
    text = safefs.read_small(paths.guard) or ""
    found = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("event") == "skip" and isinstance(row.get("bad_samples"), list):
            found += [list(p) for p in row["bad_samples"] if sample_pair(p)]
    return found


def sample_pair(value: Any) -> bool:
    """``[dataset index, epoch]``: two counts."""
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )
