"""``metrics.jsonl``: one JSON object per line, appended by rank 0 and flushed per line.

Every line has ``kind``, ``step``, ``epoch`` and ``time_s`` (training wall time, accumulated over
restarts). Kinds: ``start`` (each launch), ``train``, ``eval``, ``stop`` (stop signal), ``end``. A
``start`` line names the task's ``best_metric`` and ``higher_is_better`` (what the tools rank by) and
the ``launch`` number. The sinks (loggers) also get ``checkpoint`` events (:meth:`MetricsWriter.event`).

The file is the run's own record: written here, synchronously, a local append. The sinks are the
loggers of ``loggers.open_sinks``, each behind its bounded queue: a record handed to them never waits,
and closing waits for their backlog a bounded time (``loggers.boundary``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ddp_slurm import safefs
from ddp_slurm.train.loggers import boundary


class MetricsWriter:
    def __init__(self, path: Path | None, shared: bool = False, sinks: Iterable[Any] = ()) -> None:
        """``path=None`` (ranks other than 0) makes every call a no-op. The file is appended to across
        launches, so it is opened without following a symlink and must be this user's plain file
        (``safefs.open_owned``; ``shared``: ``run.shared``). ``sinks``: writers with the same
        ``write``/``close`` that get every record too (``loggers.open_sinks``); None entries are skipped."""
        self._file = None
        self.launch = 0  # which launch of the run this is (1 = the first); known on rank 0 only
        self._sinks = [s for s in sinks if s is not None]
        if path is not None:
            try:
                # opened (and so checked: no symlink, FIFO or foreign file) before it is read for the count
                fd = safefs.open_owned(path, os.O_WRONLY | os.O_APPEND, shared)
                self._file = os.fdopen(fd, "a", buffering=1)
                self.launch = 1 + sum(1 for row in read(path) if row.get("kind") == "start")
            except BaseException:
                self.close()  # the loggers already opened end their run (as failed)
                raise

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        if self._file is not None:
            row = {"kind": kind, "step": step, "epoch": epoch, "time_s": round(time_s, 3), **fields}
            self._file.write(json.dumps(row) + "\n")
        for sink in self._sinks:
            sink.write(kind, step, epoch, time_s, **fields)

    def event(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        """A record for the sinks only (loggers), not for metrics.jsonl: ``checkpoint``."""
        for sink in self._sinks:
            sink.write(kind, step, epoch, time_s, **fields)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # a sink that saw no "end" or "stop" record ends its run as failed

    def close(self) -> None:
        """Idempotent: the loop closes after its last record; the way out of an error closes again."""
        if self._file is not None:
            self._file.close()
            self._file = None
        sinks, self._sinks = self._sinks, []
        boundary.close_all(sinks)  # together, under one bounded wait (boundary.CLOSE_TIMEOUT_S)


def read(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a metrics file; a half-written last line (a run still going, or killed) is ignored."""
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
