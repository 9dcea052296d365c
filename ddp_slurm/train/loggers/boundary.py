"""The line between the training thread and a logger: a bounded queue the training thread never waits on.

A logger talks to things training does not control: a tracking server that accepts the connection and
never answers, a file system that stalls, a library that retries for minutes. Called from the training
thread, any of them stopped the whole job: rank 0 sat inside the call, the other ranks timed out at
``dist.timeout_s``, and a stop signal set the flag but the loop never came back to read it.

:class:`Boundary` runs ONE logger in its own daemon thread: the logger is opened there (opening is
where servers hang most: the first request) and every record reaches it through a queue of
:data:`QUEUE_RECORDS` records. ``write`` only appends under a lock the thread holds for a ``popleft``,
never while the logger runs. One thread per logger rather than one for all: a stuck MLflow server must
not starve the CSV files or TensorBoard, and each logger keeps its own order of records. Four idle
threads cost nothing next to a training process.

* Full queue: the record is dropped and counted; at close one warning names the logger and the count.
  The last :data:`RESERVED` slots are kept for the ``end`` and ``stop`` records, which say how the
  logger's run ends (FINISHED, KILLED), so a logger that fell behind still learns how training ended.
* Close: :func:`close_all` asks every logger to finish its backlog and waits for them all together, at
  most :data:`CLOSE_TIMEOUT_S`, or :data:`STOP_CLOSE_TIMEOUT_S` after a ``stop`` record: a stopped job
  is on the scheduler's clock (Slurm sends SIGKILL ``KillWait`` seconds after SIGTERM, often 30, and
  the checkpoint has used part of them), and exit 75 must come before that. A logger still busy then
  is abandoned with one warning (its daemon thread may stay blocked; the process leaves without it,
  with the training's exit code).
* A logger that raises is switched off with one warning (:class:`.guard.Guarded`), as before.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ddp_slurm.train.loggers.guard import Guarded

log = logging.getLogger("ddp_slurm")

QUEUE_RECORDS = 1024
"""Records a logger may fall behind by before new ones are dropped (train records come every
``train.log_every_steps``: minutes of training at any sensible setting)."""
RESERVED = 2
"""Slots beyond QUEUE_RECORDS that only a final record (``end``, ``stop``) may take."""
FINAL = ("end", "stop")
CLOSE_TIMEOUT_S = 30.0
"""How long the end of training (or an error) waits, for all loggers together, for their backlog."""
STOP_CLOSE_TIMEOUT_S = 5.0
"""The same wait after a stop signal (see the module doc)."""


class Boundary:
    """A logger (``opener()`` builds it, in the thread) fed through a bounded queue; see the module doc."""

    def __init__(self, key: str, opener: Callable[[], Any]) -> None:
        self.key = key
        self.dropped = 0
        self.stopped = False  # a stop record was written: training stopped on a signal
        self._opener = opener
        self._sink: Guarded | None = None
        self._queue: collections.deque[tuple[str, int, int, float, dict[str, Any]]] = collections.deque()
        self._ready = threading.Condition()
        self._closing = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"logger {key}", daemon=True)
        self._thread.start()

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        """Queue the record, or drop it when the logger is :data:`QUEUE_RECORDS` behind: never waits."""
        with self._ready:
            if self._closing:
                return
            self.stopped = self.stopped or kind == "stop"
            if len(self._queue) >= QUEUE_RECORDS + (RESERVED if kind in FINAL else 0):
                self.dropped += 1
                return
            self._queue.append((kind, step, epoch, time_s, fields))
            self._ready.notify()

    def _next(self) -> tuple[str, int, int, float, dict[str, Any]] | None:
        with self._ready:
            while not self._queue and not self._closing:
                self._ready.wait()
            return self._queue.popleft() if self._queue else None

    def _run(self) -> None:
        try:
            self._sink = Guarded(self.key, self._opener)
            while (record := self._next()) is not None:
                kind, step, epoch, time_s, fields = record
                self._sink.write(kind, step, epoch, time_s, **fields)
            self._sink.close()
        except BaseException as exc:  # Guarded holds Exception; a library's SystemExit must not pass silently
            self._sink = None
            log.warning("%s: stopped (%s); training goes on without this logger", self.key, type(exc).__name__)
        finally:
            self._done.set()

    def begin_close(self) -> None:
        """No more records: the thread sends its backlog, closes the logger and ends."""
        with self._ready:
            self._closing = True
            self._ready.notify()

    def wait_closed(self, deadline: float, timeout_s: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic``, ``timeout_s`` after the close began) for the backlog;
        False (one warning) if the logger is abandoned."""
        finished = self._done.wait(max(0.0, deadline - time.monotonic()))
        off = self._sink is None or self._sink.failed  # (once finished) switched off: its one warning is given
        with self._ready:
            backlog = len(self._queue)
        if not finished:
            log.warning(
                "%s: still busy %g s after the last record (%d records not sent, %d dropped before); "
                "abandoned, training goes on without this logger",
                self.key,
                timeout_s,
                backlog,
                self.dropped,
            )
        elif self.dropped and not off:
            log.warning(
                "%s: %d records dropped: the logger fell %d records behind (metrics.jsonl has them all)",
                self.key,
                self.dropped,
                QUEUE_RECORDS,
            )
        return finished

    def close(self) -> None:
        close_all([self])


def close_all(sinks: Iterable[Any], timeout_s: float | None = None) -> None:
    """Close every sink: the :class:`Boundary` ones drain in parallel under one deadline, ``timeout_s``
    from now (None: :data:`CLOSE_TIMEOUT_S`, or :data:`STOP_CLOSE_TIMEOUT_S` once a stop record was
    written); any other sink (a plain writer with ``close``) is closed in place."""
    sinks = list(sinks)
    bounded = [s for s in sinks if isinstance(s, Boundary)]
    for sink in bounded:
        sink.begin_close()
    if timeout_s is None:
        timeout_s = STOP_CLOSE_TIMEOUT_S if any(s.stopped for s in bounded) else CLOSE_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    for sink in sinks:
        if isinstance(sink, Boundary):
            sink.wait_closed(deadline, timeout_s)
        else:
            sink.close()
