"""A sweep directory's manifest, ``sweep.json``: what ``submit --sweep`` submitted, read back by the tools.

``submit`` writes it once the job array is queued: the array's job id, the overrides every run shares
and, per array task, the run it trains (a directory under the sweep) and that run's own overrides.
``report`` reads it to list a sweep's runs in order, ``submit --summary`` to line them up by the swept
values.

Why here, below the launchers: the tools read it, and a tool must not import the launchers that sit on
top of it. Why so careful: a sweep directory lies on a shared file system, so the file may be a
symlink (to ``/dev/zero``), a FIFO, huge, or a JSON document of another shape; each is one line (exit 2),
never a hang or a traceback, and a run name is a plain directory name (never ``../elsewhere``).
"""

from __future__ import annotations

import errno
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_slurm import config, safefs
from ddp_slurm.errors import UsageError
from ddp_slurm.runpaths import RunPaths

MAX_BYTES = 4 << 20  # about 20 000 runs' entries; more is not a manifest this program wrote


@dataclass(frozen=True)
class Entry:
    """One run of the sweep: its array task, its directory name under the sweep, its own overrides."""

    task: int
    name: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    job_id: str  # the array's job id (the local executor: its jobs' ids, comma-separated)
    overrides: tuple[str, ...]  # what every run of the sweep was given
    runs: tuple[Entry, ...]

    def to_json(self) -> str:
        runs = [{"task": r.task, "name": r.name, "overrides": list(r.overrides)} for r in self.runs]
        return json.dumps({"job_id": self.job_id, "overrides": list(self.overrides), "runs": runs}, indent=2) + "\n"


def write(sweep_dir: Path, manifest: Manifest, shared: bool = False) -> None:
    """``sweep_dir/sweep.json``, atomically and never through a symlink (``safefs.write_atomic``)."""
    safefs.make_dir(Path(sweep_dir), shared)
    data = manifest.to_json().encode()
    safefs.write_atomic(RunPaths(sweep_dir).sweep, lambda f: f.write(data), shared)


def read(sweep_dir: Path) -> Manifest | None:
    """The manifest of ``sweep_dir``, or None when it has none (not a sweep). A file that is not one this
    program wrote (a symlink, a FIFO, a directory, too large, not JSON, another shape) is a UsageError
    whose one line names it and the way out."""
    path = RunPaths(sweep_dir).sweep
    try:
        text = safefs.read_small(path, MAX_BYTES)
    except safefs.UnsafePath as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:  # sweep_dir is a file: not a sweep
            return None
        raise UsageError(f"{path} cannot be read: {exc.strerror}") from None
    if text is None:
        return None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        _bad(path, "is not JSON")
    return _checked(path, data)


def _bad(path: Path, what: str) -> Any:
    raise UsageError(f"{path} {what}: not a sweep manifest this program wrote; move it away or remove it")


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and not config.CONTROL.search(v) for v in value)


def _checked(path: Path, data: Any) -> Manifest:
    """The manifest's fields, each of the type ``write`` gives it."""
    if not isinstance(data, dict):
        _bad(path, f"holds a JSON {type(data).__name__}, not an object")
    runs, job_id = data.get("runs"), data.get("job_id")
    if not isinstance(runs, list):
        _bad(path, "has no list of 'runs'")
    if not isinstance(job_id, (str, int)) or isinstance(job_id, bool) or config.CONTROL.search(str(job_id)):
        _bad(path, "has no 'job_id' (a string)")
    if not _strings(data.get("overrides", [])):
        _bad(path, "has 'overrides' that are not a list of strings")
    entries = []
    for i, run in enumerate(runs):
        if not isinstance(run, dict):
            _bad(path, f"has run {i} that is not an object")
        name, task, overrides = run.get("name"), run.get("task", i), run.get("overrides", [])
        if not isinstance(name, str) or not config.RUN_NAME.fullmatch(name):
            _bad(path, f"has run {i} whose 'name' is not a run directory's name")
        if not isinstance(task, int) or isinstance(task, bool) or not _strings(overrides):
            _bad(path, f"has run {i} without an integer 'task' and a list of string 'overrides'")
        entries.append(Entry(task, name, tuple(overrides)))
    swept = [_keys(e.overrides) for e in entries]
    if any(keys != swept[0] for keys in swept):
        _bad(path, "has runs that do not vary the same keys")
    return Manifest(str(job_id), tuple(data.get("overrides", [])), tuple(entries))


def _keys(overrides: Sequence[str]) -> list[str]:
    return [o.partition("=")[0] for o in overrides]


def swept_keys(manifest: Manifest) -> list[str]:
    """The keys the sweep varies, in the order of its ``--sweep`` flags."""
    return _keys(manifest.runs[0].overrides) if manifest.runs else []
