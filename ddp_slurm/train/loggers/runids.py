"""``<run_dir>/loggers.json``: each logger's run id, so that every launch of a run logs into ONE logger run.

A requeued or relaunched job reads the id its first launch created and resumes that logger run instead
of starting a new one. Written atomically by rank 0, the only process that logs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddp_slurm import safefs

FILE = "loggers.json"


class RunIds:
    def __init__(self, run_dir: Path, shared: bool = False) -> None:
        self.path = run_dir / FILE
        self.shared = shared

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, logger: str) -> dict[str, Any] | None:
        """What ``logger`` saved for this run (its run id and where), or None on the first launch."""
        entry = self._read().get(logger)
        return entry if isinstance(entry, dict) else None

    def put(self, logger: str, entry: dict[str, Any]) -> None:
        data = self._read() | {logger: entry}
        text = json.dumps(data, indent=1, sort_keys=True).encode()
        safefs.write_atomic(self.path, lambda f: f.write(text), self.shared)
