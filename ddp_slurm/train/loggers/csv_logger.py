"""CSV files: ``log.csv=true`` writes ``<run_dir>/csv/<kind>.csv`` (``train.csv``, ``eval.csv``, ``events.csv``).

One wide table per kind of record, as spreadsheets and ``pandas.read_csv`` want them: columns ``step``,
``epoch``, ``time_s`` then the record's fields in the order first seen. A record with a new field (a
gradient norm switched on in a later launch) rewrites the file with the wider header. Steps that an
earlier launch logged after the checkpoint this launch resumed from were redone: their rows are dropped,
so the files always hold the run's one history (metrics.jsonl keeps everything).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from ddp_slurm import safefs

SUBDIR = "csv"
_POSITION = ["step", "epoch", "time_s"]
_FILES = {"train": "train", "eval": "eval"}  # everything else is an event


class CsvSink:
    def __init__(self, run_dir: Path) -> None:
        self.folder = run_dir / SUBDIR
        self.folder.mkdir(exist_ok=True)
        self._headers: dict[str, list[str]] = {}  # each file's columns, read once per launch

    def _table(self, name: str) -> tuple[list[str], list[dict[str, str]]]:
        path = self.folder / f"{name}.csv"
        if not path.is_file():
            return [], []
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            return list(reader.fieldnames or []), list(reader)

    def _rewrite(self, name: str, header: list[str], rows: list[dict[str, Any]]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, header, restval="")
        writer.writeheader()
        writer.writerows(rows)
        data = text.getvalue().encode()
        safefs.write_atomic(self.folder / f"{name}.csv", lambda f: f.write(data))

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        name = _FILES.get(kind, "events")
        row = {"step": step, "epoch": epoch, "time_s": round(time_s, 3)}
        row |= {"kind": kind} if name == "events" else {}
        row |= {k: ("" if v is None else v) for k, v in fields.items()}
        if kind == "start" and fields.get("resumed"):
            self._drop_after(step)
        if name not in self._headers:
            self._headers[name] = self._table(name)[0]
        header = self._headers[name]
        new = [k for k in row if k not in header]
        if new or not header:
            header = (header or _POSITION) + [k for k in new if k not in _POSITION]
            self._rewrite(name, header, [*self._table(name)[1], row])
            self._headers[name] = header
            return
        with open(self.folder / f"{name}.csv", "a", newline="") as f:
            csv.DictWriter(f, header, restval="").writerow(row)

    def _drop_after(self, step: int) -> None:
        """A resume at ``step``: rows after it in train/eval were redone by this launch (see the module doc)."""
        for name in _FILES.values():
            header, rows = self._table(name)
            kept = [r for r in rows if int(r["step"]) <= step]
            if len(kept) != len(rows):
                self._rewrite(name, header, kept)

    def close(self) -> None:
        pass
