"""A logger failure is one warning, never a stopped training run.

:class:`Guarded` opens its logger lazily-safe (the opener may raise: package missing, store unwritable,
server down) and forwards every record; the first exception, at open or later, is logged once as a
warning naming the config key, and the logger is switched off for the rest of the launch. It runs in
the logger's own thread (:mod:`.boundary`), so a failure here never reaches the training thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ddp_slurm")


class Guarded:
    """A sink whose failures are contained (see the module docstring)."""

    def __init__(self, key: str, opener: Callable[[], Any]) -> None:
        self.key = key
        self.sink: Any = None
        self.failed = False  # switched off by an exception (its one warning given)
        try:
            self.sink = opener()
        except Exception as exc:  # whatever a third-party logger raises, training goes on
            self._fail("could not start", exc)

    def _fail(self, what: str, exc: BaseException) -> None:
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        log.warning("%s: %s (%s: %s); training goes on without this logger", self.key, what, type(exc).__name__, detail)
        self.sink = None
        self.failed = True

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        if self.sink is None:
            return
        try:
            self.sink.write(kind, step, epoch, time_s, **fields)
        except Exception as exc:
            self._fail(f"logging a {kind} record failed", exc)

    def close(self) -> None:
        if self.sink is None:
            return
        try:
            self.sink.close()
        except Exception as exc:
            self._fail("closing failed", exc)
        self.sink = None
