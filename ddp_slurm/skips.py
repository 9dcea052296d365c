"""Steps whose batches are never trained on: the guard's skipped windows and ``guard.skip`` by hand.

A step is named as the log counts it (1 is the first). Step ``s`` trains global batch ``s - 1`` of the data
order (``train/loader.py``: epoch ``(s-1) // steps_per_epoch``, that epoch's batch ``(s-1) % steps_per_epoch``),
whose samples are the global positions ``[(s-1)*G, s*G)`` for ``G = train.global_batch_size``. A skipped step
still counts: the data moves on by its batch and the step number by one, with no forward, backward or update
(and no schedule step), so every other step keeps the very batch it had, at any world size and worker count.
"""

from __future__ import annotations

import re

_RANGE = re.compile(r"\s*(\d{1,12})\s*(?:-\s*(\d{1,12})\s*)?")
MAX_RANGES = 10_000  # a hand-written list or a run's own record; more is not a list of windows


def parse(text: str) -> list[tuple[int, int]]:
    """``"1201-1400, 1650"`` -> ``[(1201, 1400), (1650, 1650)]``; ValueError saying what is wrong."""
    out = []
    for part in text.split(","):
        m = _RANGE.fullmatch(part)
        if m is None:
            raise ValueError(f"{part.strip()!r} is not a step or a 'first-last' range of steps")
        first, last = int(m[1]), int(m[2] or m[1])
        if first < 1 or last < first:
            raise ValueError(f"{part.strip()!r}: steps count from 1, and a range's last step is not before its first")
        out.append((first, last))
    if len(out) > MAX_RANGES:
        raise ValueError(f"more than {MAX_RANGES} ranges")
    return merged(out)


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching ranges joined."""
    out: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


_SAMPLE = re.compile(r"\s*(\d{1,12}|[^\s,@:]{1,255}:[^\s,@]{1,255})\s*(?:@\s*(\d{1,6})\s*)?")


def parse_samples(text: str) -> list[tuple[int | str, int]]:
    """``"300, 512@2, shard-000003.tar:cat42@1"`` -> ``[(300, 0), (512, 2), ("shard-000003.tar:cat42", 1)]``:
    samples left out of training (a dataset index, or a sharded sample's ``shard.tar:key`` name), each from an
    epoch on (counted from 0; every epoch without ``@``); ValueError saying what is wrong."""
    out: list[tuple[int | str, int]] = []
    for part in text.split(","):
        m = _SAMPLE.fullmatch(part)
        if m is None:
            raise ValueError(f"{part.strip()!r} is not a dataset index, a shard.tar:key name, or either @EPOCH")
        out.append((int(m[1]) if m[1].isdigit() else m[1], int(m[2] or 0)))
    if len(out) > MAX_RANGES:
        raise ValueError(f"more than {MAX_RANGES} samples")
    return sorted(set(out), key=lambda p: (isinstance(p[0], str), p))

    return sorted(set(out))


def valid(value: object) -> bool:
    """Whether ``value`` (read back from a checkpoint or a run's record) is a list of ``[first, last]`` steps."""
    return (
        isinstance(value, list)
        and len(value) <= MAX_RANGES
        and all(
            isinstance(r, (list, tuple))
            and len(r) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
            and 1 <= r[0] <= r[1]
            for r in value
        )
    )


def show(ranges: list[tuple[int, int]]) -> str:
    """``[(1201, 1400), (1650, 1650)]`` -> ``"1201-1400,1650"`` (what ``parse`` reads)."""
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


class Skips:
    """The run's skipped steps: ``covers(step)`` per step, ``add`` when the guard skips a window."""

    def __init__(self, ranges: list[tuple[int, int]] = ()) -> None:
        self.ranges = merged(list(ranges))

    def covers(self, step: int) -> bool:
        return any(first <= step <= last for first, last in self.ranges)

    def covers_all(self, first: int, last: int) -> bool:
        """Whether every step from ``first`` to ``last`` is skipped (ranges are merged: one must hold them all)."""
        return any(a <= first and last <= b for a, b in self.ranges)

    def add(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = merged(self.ranges + [tuple(r) for r in ranges])

    def as_list(self) -> list[list[int]]:
        return [[a, b] for a, b in self.ranges]

    def __bool__(self) -> bool:
        return bool(self.ranges)
