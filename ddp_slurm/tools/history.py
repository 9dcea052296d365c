"""A run's history as ``metrics.jsonl`` tells it, read back for ``report`` and its figures.

The lines of a step logged twice: the later one counts. A run goes back in two ways, and the lines that
say so start a new segment: each launch writes a ``start`` line at the step it resumed from, and the
guard a ``rollback`` line naming the checkpoint it went back to (``to``, in the same process) and, when
a replay showed bad data, a ``skip`` line (it goes back again, before the skipped steps). Lines an earlier
segment logged for steps after that point were redone (or never checkpointed, or skipped), so they are
dropped and the later values kept (``_redone_after``). Every line is checked against the fields this
program writes: another file is refused with the line that shows it.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_slurm import config, errors, safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.text import CONTROL, shown
from ddp_slurm.tools import tracked
from ddp_slurm.tools.rollbacks import Rollback, collect

MAX_METRICS_BYTES = 1 << 30  # a line per logged step: a long run writes tens of MB


class ReportError(errors.UsageError):
    """Nothing to report on (no run directory or no metrics); the message is one line (exit 2)."""


@dataclass
class RunHistory:
    """A run's metrics with redone steps resolved: the latest launch's values win."""

    run_dir: Path
    batch_size: int | None  # train.global_batch_size from config.yaml (None: x axes in steps)
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    stops: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[Rollback] = field(default_factory=list)  # the guard's, with their verdicts
    early_stop: dict[str, Any] | None = None  # the `early_stop` line that ended the run (eval.patience)
    last: dict[str, Any] | None = None  # the last complete line of the file
    ended: bool = False  # an `end` line after the last start
    metric: tracked.Tracked = field(default_factory=lambda: tracked.Tracked(None))  # the task's best_metric
    steps_per_epoch: int | None = None  # from the start lines (None: written before they said)

    def samples(self, step: int) -> int:
        return step * (self.batch_size or 1)


def read_history(run_dir: Path) -> RunHistory:
    """A run directory's metrics.jsonl, with redone steps resolved; ReportError when there is nothing to read."""
    path = RunPaths(run_dir).metrics
    if not path.is_file():
        raise ReportError(f"{path} does not exist: pass a run directory (runs/<run.name>) that has started training")
    try:  # the runtime's keys only: the task the config names is never imported
        batch: int | None = config.read_resolved(RunPaths(run_dir).config).train.global_batch_size
    except config.ConfigError:  # an old, hand-edited or missing config: plot against steps instead of samples
        batch = None
    run = RunHistory(run_dir, batch)
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for row in _rows(path):
        kind, step = row["kind"], row["step"]
        run.last = row
        redone = _redone_after(row)
        if redone is not None:  # a new segment: its numbers stand for the steps after `redone`
            for seen in (train, evals):
                for s in [s for s in seen if s > redone]:
                    del seen[s]
        if kind == "start":
            run.starts.append(row)
            run.ended = False
            run.early_stop = None
        elif kind == "train" and "loss" in row:
            train[step] = {**row, "launch": len(run.starts)}  # which launch logged it: throughput per launch
        elif kind == "eval":
            evals[step] = row
        elif kind == "stop":
            run.stops.append(row)
        elif kind == "early_stop":
            run.early_stop = row
        elif kind == "end":
            run.ended = True
        elif kind in ("rollback", "replay", "skip"):
            collect(run.rollbacks, row)
    if run.last is None:
        raise ReportError(f"{path} holds no complete line yet: run the report again once training has started")
    run.train = [train[s] for s in sorted(train)]
    run.evals = [evals[s] for s in sorted(evals)]
    run.metric = tracked.from_rows(run.starts, run.evals)
    run.steps_per_epoch = next((r["steps_per_epoch"] for r in reversed(run.starts) if r.get("steps_per_epoch")), None)
    return run


def _redone_after(row: dict[str, Any]) -> int | None:
    """The step after which every step is run again from this line on (None: the line moves nothing back).
    The one home of the rule: everything that reads a run's history (report, export, resume) gets it here."""
    kind = row["kind"]
    if kind == "start":  # a launch resumed from the checkpoint of `step`
        return row["step"]
    if kind == "rollback":  # the guard restored the checkpoint of `to` and replays from there
        return row["to"]
    if kind == "skip":  # the guard went back again to a checkpoint before the skipped steps, never trained again
        return row["steps"][0] - 1
    return None


def eval_metrics(run: RunHistory) -> list[str]:
    """The run's eval metrics, the tracked one first."""
    names = tracked.eval_metrics(run.evals)
    first = [run.metric.name] if run.metric.name in names else []
    return first + [n for n in names if n not in first]


# Fields a metrics line may have, and their types: anything else is not a file this program wrote.
_NUMBER = (int, float)
_FIELDS: dict[str, tuple[type, ...]] = {
    "kind": (str,),
    "step": (int,),
    "epoch": (int,),
    "time_s": _NUMBER,
    "loss": _NUMBER,
    "samples_per_s": _NUMBER,
    "accuracy": _NUMBER,
    "world_size": (int,),
    "restart_count": (int,),
    "launch": (int,),
    "steps_per_epoch": (int,),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list_of(test: Callable[[Any], bool], length: int | None = None) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and (length is None or len(v) == length) and all(map(test, v))


_STEPS = (lambda v: _list_of(_is_int, 2)(v) and 1 <= v[0] <= v[1], "a [first, last] pair of steps from 1")
# The guard's lines: the fields the report reads from them (``rollbacks.describe``, ``_redone_after``),
# checked per kind since ``steps`` is a count in a replay line and a range in a skip line. Required:
# the one each line moves the history back by.
_GUARD_FIELDS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "rollback": {
        "to": (_is_int, "an integer"),
        "rollback": (_is_int, "an integer"),
        "why": (lambda v: isinstance(v, str), "a string"),
        "suspect": _STEPS,
    },
    "replay": {
        "verdict": (lambda v: isinstance(v, str), "a string"),
        "ranks": (_list_of(_is_int), "a list of ranks"),
        "hosts": (_list_of(lambda v: isinstance(v, str)), "a list of host names"),
        "at": (_is_int, "an integer"),
    },
    "skip": {
        "steps": _STEPS,
        "samples": (_list_of(_is_int, 2), "a [start, end) pair of sample positions"),
        "bad_samples": (_list_of(_list_of(_is_int, 2)), "a list of [dataset index, epoch] pairs"),
        "bad_names": (_list_of(lambda v: isinstance(v, str)), "a list of sample names (shard.tar:key)"),
    },
}
_REQUIRED = {"rollback": "to", "replay": "verdict", "skip": "steps"}


def _check_guard(row: dict[str, Any], where: str) -> None:
    fields = _GUARD_FIELDS.get(row["kind"], {})
    for key, (test, expected) in fields.items():
        value = row.get(key)
        if (value is not None or key == _REQUIRED[row["kind"]]) and not test(value):
            raise ReportError(
                f"{where}: {key!r} is {reprlib.repr(value)}, expected {expected}; not a metrics file of this program"
            )


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of ``metrics.jsonl``, each checked: a line that is not a JSON object with the documented
    fields and types is a ReportError naming the line (a half-written last line is skipped)."""
    try:  # never through a symlink (to /dev/zero, say), never blocked by a FIFO, never without bound
        lines = (safefs.read_small(path, MAX_METRICS_BYTES) or "").splitlines()
    except safefs.UnsafePath as exc:
        raise ReportError(str(exc)) from None
    except OSError as exc:
        raise ReportError(f"{path} cannot be read: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue  # a half-written line (a run still going, or killed)
        if "\\" in line or CONTROL.search(line):  # an escape in JSON: maybe a control character in a string
            row = _shown(row)
        where = f"{path} line {number}"
        if not isinstance(row, dict):
            raise ReportError(
                f"{where} is a JSON {type(row).__name__}, not an object: not a metrics file of this program"
            )
        for key, types in _FIELDS.items():
            value = row.get(key)
            if (key in ("kind", "step") or value is not None) and (
                not isinstance(value, types) or isinstance(value, bool)
            ):
                raise ReportError(
                    f"{where}: {key!r} is {reprlib.repr(value)}, expected {' or '.join(t.__name__ for t in types)}; "
                    "not a metrics file of this program"
                )
        _check_guard(row, where)
        yield row


def _shown(value: Any) -> Any:
    """Every string of a row, keys included, safe to print (``text.shown``): what the summary, the figures and
    the guard's lines show of a metrics file can never drive the terminal or forge a line."""
    if isinstance(value, str):
        return shown(value)
    if isinstance(value, dict):
        return {_shown(k): _shown(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shown(v) for v in value]
    return value
