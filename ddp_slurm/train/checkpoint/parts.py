"""What a checkpoint holds beside the model and optimizer: registered parts, each one thing that must survive
a requeue (torchtitan's ``states={...}`` and torchtnt's ``app_state()`` are the model).

A part names its keys in the checkpoint's record and the check each value passes before a resume uses it
(``keys``: every checkpoint of this release holds them; ``optional``: checkpoints made before the part existed
do not, and the part then keeps its fresh state), whether its value is one per rank (``per_rank``: gathered
from every rank into a list, rank by rank), how it is taken (``take``) and how it is put back (``put``).
The checkpointer's backends loop over the run's parts (``Parts``) on both paths; the record's schema
(``schema.py``) takes its keys and checks from the standard parts (``standard.py``).

A side feature with state is one file: a hook (or a task, or a batch source) returns its parts from
``parts()``, and the loop registers them (``Parts.add``). A part registered after the checkpoint was
restored gets its value then: the restored record's values nobody claimed wait for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

Check = tuple[Callable[[Any], bool], str]
"""A value's check and what it must be, for the one-line refusal ("its step is not a count")."""


@dataclass(frozen=True)
class Moment:
    """The save a part is taken for: whether the run has finished, and its training time so far."""

    finished: bool = False
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class Restoring:
    """The restore a part is put back in: this rank, the world size, the run's seed and device, and the words
    of the one warning a changed world size gives (``what`` was saved; what ``changed``)."""

    rank: int
    world_size: int
    seed: int
    device: Any
    what: str = "a checkpoint"
    changed: str = ""


class Part:
    """One registered part (see the module docstring). ``take`` returns ``{key: value}`` for its keys (a
    per-rank part: its one key, this rank's value); ``put`` gets the record's values of its keys that are
    there (a per-rank part: every saved rank's values, a list)."""

    keys: ClassVar[Mapping[str, Check]] = {}
    optional: ClassVar[Mapping[str, Check]] = {}
    per_rank: bool = False

    def take(self, now: Moment) -> dict[str, Any]:
        raise NotImplementedError

    def put(self, saved: dict[str, Any], how: Restoring) -> None:
        raise NotImplementedError

    def checks(self) -> dict[str, Check]:
        return {**self.keys, **self.optional}


class Stateful(Part):
    """Any object with ``state_dict()`` / ``load_state_dict(state)`` as a part under ``key`` (optional: a
    checkpoint without it leaves the object as it is). ``per_rank``: each rank's own state, restored at the same
    world size (at another, the object starts fresh). ``check``: what the value must be (a mapping by default)."""

    def __init__(self, key: str, obj: Any, *, per_rank: bool = False, check: Check | None = None) -> None:
        self.key, self.obj, self.per_rank = key, obj, per_rank
        self.check = check or ((lambda v: isinstance(v, dict)), "a mapping")

    def checks(self) -> dict[str, Check]:
        if not self.per_rank:
            return {self.key: self.check}
        ok, what = self.check
        return {self.key: (lambda v: isinstance(v, list) and all(ok(x) for x in v), f"a list of {what}, one per rank")}

    def take(self, now: Moment) -> dict[str, Any]:
        return {self.key: self.obj.state_dict()}

    def put(self, saved: dict[str, Any], how: Restoring) -> None:
        if self.key not in saved:
            return
        value = saved[self.key]
        if self.per_rank:
            if len(value) != how.world_size:
                return  # another world size: this rank's state has no counterpart
            value = value[how.rank]
        self.obj.load_state_dict(value)


class Parts:
    """The run's registered parts, in order (they are put back in this order)."""

    def __init__(self, parts: Iterable[Part] = ()) -> None:
        self._parts: list[Part] = []
        self._waiting: dict[str, Any] = {}  # restored values no part has claimed yet
        self._how: Restoring | None = None
        for part in parts:
            self.add(part)

    def __iter__(self) -> Any:
        return iter(self._parts)

    def of(self, kind: type) -> Any:
        """The registered part of type ``kind`` (LookupError if none)."""
        for part in self._parts:
            if isinstance(part, kind):
                return part
        raise LookupError(f"no {kind.__name__} part registered")

    def add(self, part: Part) -> None:
        """Register ``part`` after the others. ValueError when one of its keys is taken. Registered after a
        restore: it gets the restored values of its keys now (a ValueError if they fail its checks)."""
        taken = {key for p in self._parts for key in p.checks()}
        clash = sorted(taken & set(part.checks()))
        if clash:
            raise ValueError(f"checkpoint part {type(part).__name__}: its key(s) {', '.join(clash)} are taken")
        self._parts.append(part)
        mine = {k: self._waiting.pop(k) for k in list(self._waiting) if k in part.checks()}
        if self._how is not None and mine:
            check_values(mine, part.checks())
            part.put(mine, self._how)

    def checks(self) -> tuple[dict[str, Check], dict[str, Check]]:
        """(the keys every record must hold, the keys checked where a record holds them)."""
        required: dict[str, Check] = {}
        optional: dict[str, Check] = {}
        for part in self._parts:
            required |= dict(part.keys)
            optional |= {k: c for k, c in part.checks().items() if k not in part.keys}
        return required, optional

    def take(self, now: Moment, gather: Callable[[Any], list[Any] | None]) -> dict[str, Any] | None:
        """Every rank (a collective: ``gather`` brings every rank's per-rank values to rank 0 in one call):
        the record of every part on rank 0, None on the others."""
        own: dict[str, Any] = {}
        shared: dict[str, Any] = {}
        for part in self._parts:
            (own if part.per_rank else shared).update(part.take(now))
        everyone = gather(own)
        if everyone is None:
            return None
        return shared | {key: [ranks[key] for ranks in everyone] for key in own}

    def put(self, record: Mapping[str, Any], how: Restoring, owned: Iterable[str] = ()) -> None:
        """Every rank: every part gets its keys' values from ``record`` (those it holds); values of keys no
        part knows wait for a part registered later (not the backend's ``owned`` keys: the model's state)."""
        self._how = how
        known = set(owned)
        for part in self._parts:
            names = part.checks()
            known |= set(names)
            part.put({k: record[k] for k in names if k in record}, how)
        self._waiting = {k: v for k, v in record.items() if k not in known}


def check_values(values: Mapping[str, Any], checks: Mapping[str, Check]) -> None:
    """ValueError naming the first value that fails its check."""
    for key, (ok, what) in checks.items():
        if key in values and not ok(values[key]):
            raise ValueError(f"its {key} is not {what} ({values[key]!r:.40})")
