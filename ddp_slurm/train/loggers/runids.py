"""``<run_dir>/loggers.json``: each logger's run id, so that every launch of a run logs into ONE logger run.

A requeued or relaunched job reads the id its first launch created and resumes that logger run instead
of starting a new one. Written atomically by rank 0, the only process that logs, under a lock: the
loggers open in threads of their own (:mod:`.boundary`) and two first launches' ids must not overwrite
each other. Read back with
``safefs.read_small``: a symlink, FIFO or oversized file there refuses the logger (``UnsafePath``, one
warning) rather than reuse an id somebody else planted.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths


class RunIds:
    def __init__(self, paths: RunPaths) -> None:
        self.path = paths.loggers
        self.shared = paths.shared
        self._lock = threading.Lock()  # one RunIds serves every logger of the process

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(safefs.read_small(self.path) or "{}")
        except (OSError, ValueError):  # unreadable or half-written: the next put replaces it
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, logger: str) -> dict[str, Any] | None:
        """What ``logger`` saved for this run (its run id and where), or None on the first launch."""
        entry = self._read().get(logger)
        return entry if isinstance(entry, dict) else None

    def put(self, logger: str, entry: dict[str, Any]) -> None:
        with self._lock:
            data = self._read() | {logger: entry}
            text = json.dumps(data, indent=1, sort_keys=True).encode()
            safefs.write_atomic(self.path, lambda f: f.write(text), self.shared)
