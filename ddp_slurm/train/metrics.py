"""``metrics.jsonl``: one JSON object per line, appended by rank 0 and flushed per line.

Every line has ``kind``, ``step``, ``epoch`` and ``time_s`` (training wall time, accumulated over
restarts). Kinds: ``start`` (each launch), ``train``, ``eval``, ``stop`` (stop signal), ``end``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, path: Path | None, sinks: tuple[Any, ...] = ()) -> None:
        """``path=None`` (ranks other than 0) makes every call a no-op. ``sinks``: other writers with the same
        ``write``/``close`` (TensorBoard, ``train/tb.py``) that get every record too; None entries are skipped."""
        self._file = open(path, "a", buffering=1) if path is not None else None
        self._sinks = [s for s in sinks if s is not None]

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        if self._file is not None:
            row = {"kind": kind, "step": step, "epoch": epoch, "time_s": round(time_s, 3), **fields}
            self._file.write(json.dumps(row) + "\n")
        for sink in self._sinks:
            sink.write(kind, step, epoch, time_s, **fields)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def read(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a metrics file; a half-written last line (a run still going, or killed) is ignored."""
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
