"""CSV files: ``log.csv=true`` writes ``<run_dir>/csv/<kind>.csv`` (``train.csv``, ``eval.csv``, ``events.csv``).

One wide table per kind of record, as spreadsheets and ``pandas.read_csv`` want them: columns ``step``,
``epoch``, ``time_s`` then the record's fields in the order first seen. A record with a new field (a
gradient norm switched on in a later launch) rewrites the file with the wider header. Steps that an
earlier launch logged after the checkpoint this launch resumed from were redone: their rows are dropped,
so the files always hold the run's one history (metrics.jsonl keeps everything).

Nothing is written through a link: the folder is made with ``safefs.make_dir`` (a symlink or a file at
``csv`` refuses the logger), a file is rewritten with ``safefs.write_atomic`` (which replaces whatever is
at its name), appended to with ``safefs.append_owned`` and read back with ``safefs.read_small`` (both
refuse a symlink, FIFO or foreign file), each at most :data:`MAX_BYTES`.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths

MAX_BYTES = 256 << 20  # a file read back (header, resume): millions of rows; more is not a file we wrote
_POSITION = ["step", "epoch", "time_s"]
_FILES = {"train": "train", "eval": "eval"}  # everything else is an event


class CsvSink:
    def __init__(self, paths: RunPaths) -> None:
        self.folder = paths.csv
        self.shared = paths.shared
        safefs.make_dir(self.folder, self.shared)
        self._headers: dict[str, list[str]] = {}  # each file's columns, read once per launch

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.csv"

    def _table(self, name: str) -> tuple[list[str], list[dict[str, str]]]:
        text = safefs.read_small(self._path(name), MAX_BYTES)
        if text is None:
            return [], []
        reader = csv.DictReader(io.StringIO(text, newline=""))
        return list(reader.fieldnames or []), list(reader)

    def _rewrite(self, name: str, header: list[str], rows: list[dict[str, Any]]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, header, restval="")
        writer.writeheader()
        writer.writerows(rows)
        data = text.getvalue().encode()
        safefs.write_atomic(self._path(name), lambda f: f.write(data), self.shared)

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
        line = io.StringIO()
        csv.DictWriter(line, header, restval="").writerow(row)
        safefs.append_owned(self._path(name), line.getvalue(), self.shared)

    def _drop_after(self, step: int) -> None:
        """A resume at ``step``: rows after it in train/eval were redone by this launch (see the module doc)."""
        for name in _FILES.values():
            header, rows = self._table(name)
            kept = [r for r in rows if int(r["step"]) <= step]
            if len(kept) != len(rows):
                self._rewrite(name, header, kept)

    def close(self) -> None:
        pass
