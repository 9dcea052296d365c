"""``python -m ddp_slurm.report RUN_DIR [RUN_DIR ...]``: plots to ``report.png`` and a short summary.

One run directory: its loss, accuracy, throughput and learning rate in detail (``RUN_DIR/report.png``).
Several, a sweep directory or a folder of runs: overlaid in one figure. For runs that ran as Slurm
jobs, one line per job from ``seff`` or ``sacct`` where the cluster keeps accounting.

Reads ``metrics.jsonl`` (see :mod:`ddp_slurm.metrics`) of a finished run, a stopped one or one that
is still being written (a half-written last line is skipped). Each launch writes a ``start`` line at
the step it resumed from; steps after that point logged by an earlier launch were redone, so they
are dropped and the later launch's values kept. Restarts and stop signals are marked on the plots.
The figures are drawn by :mod:`ddp_slurm.tools.figures`.
"""

from __future__ import annotations

import argparse
import json
import os
import reprlib
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_slurm import config
from ddp_slurm.exitcodes import EXIT_OK, EXIT_USAGE
from ddp_slurm.launch import sweep
from ddp_slurm.tools import figures, jobacct


class ReportError(RuntimeError):
    """Nothing to report on (no run directory or no metrics); the message is one line."""


@dataclass
class Run:
    """A run's metrics with redone steps resolved: the latest launch's values win."""

    run_dir: Path
    batch_size: int | None  # train.global_batch_size from config.yaml (None: x axes in steps)
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    stops: list[dict[str, Any]] = field(default_factory=list)
    last: dict[str, Any] | None = None  # the last complete line of the file
    ended: bool = False  # an `end` line after the last start

    def samples(self, step: int) -> int:
        return step * (self.batch_size or 1)


def load(run_dir: Path) -> Run:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} does not exist: pass a run directory (runs/<run.name>) that has started training")
    try:
        batch: int | None = config.read_resolved(run_dir / "config.yaml").train.global_batch_size
    except Exception:  # an old or hand-edited config: plot against steps instead of samples
        batch = None
    run = Run(run_dir, batch)
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for row in _rows(path):
        kind, step = row["kind"], row["step"]
        run.last = row
        if kind == "start":
            # Resumed at `step`: whatever an earlier launch logged after it was redone (or never
            # checkpointed); drop it so that the later launch's numbers stand.
            for seen in (train, evals):
                for s in [s for s in seen if s > step]:
                    del seen[s]
            run.starts.append(row)
            run.ended = False
        elif kind == "train" and "loss" in row:
            train[step] = {**row, "launch": len(run.starts)}  # which launch logged it: throughput per launch
        elif kind == "eval" and "accuracy" in row:
            evals[step] = row
        elif kind == "stop":
            run.stops.append(row)
        elif kind == "end":
            run.ended = True
    if run.last is None:
        raise ReportError(f"{path} holds no complete line yet: run the report again once training has started")
    run.train = [train[s] for s in sorted(train)]
    run.evals = [evals[s] for s in sorted(evals)]
    return run


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
}


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of ``metrics.jsonl``, each checked: a line that is not a JSON object with the documented
    fields and types is a ReportError naming the line (a half-written last line is skipped)."""
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise ReportError(f"{path} cannot be read: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue  # a half-written line (a run still going, or killed)
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
        yield row


def summary(run: Run) -> str:
    """The text summary: status, final and best accuracy, time, restarts, mean throughput."""
    last = run.last or {}
    if run.ended:
        status = f"finished at step {last['step']}"
    elif last.get("kind") == "stop":
        status = f"stopped on a signal at step {last['step']} (launch again to resume)"
    else:
        status = f"running or interrupted, last line at step {last['step']}"
    world = next((r.get("world_size") for r in reversed(run.starts + run.train) if r.get("world_size")), None)
    lines = [f"run {run.run_dir}: {status}" + (f", world size {world}" if world else "")]
    if run.evals:
        best = max(run.evals, key=lambda r: r["accuracy"])
        lines.append(
            f"test accuracy: final {100 * run.evals[-1]['accuracy']:.2f}% (step {run.evals[-1]['step']}), "
            f"best {100 * best['accuracy']:.2f}% (step {best['step']})"
        )
    else:
        lines.append("test accuracy: no evaluation yet")
    launches = len(run.starts)
    requeues = max((r.get("restart_count", 0) for r in run.starts), default=0)
    lines.append(
        f"wall time: {last.get('time_s', 0.0):.1f} s of training; {launches} launch(es), "
        f"{max(launches - 1, 0)} restart(s), {requeues} Slurm requeue(s), {len(run.stops)} stop signal(s)"
    )
    rates = [r["samples_per_s"] for r in run.train if r.get("samples_per_s")]
    if rates:
        lines.append(f"throughput: mean {statistics.fmean(rates):,.0f} samples/s over {len(rates)} logged windows")
    return "\n".join(lines)


def expand(paths: list[Path]) -> list[Path]:
    """Run directories to report on: each path is a run directory (has metrics.jsonl), a sweep
    directory (its runs, in sweep.json's order) or a folder of run directories (each that has started)."""
    runs: list[Path] = []
    for path in paths:
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
            continue
        manifest = path / sweep.SWEEP_FILE
        if manifest.is_file():
            names = [r["name"] for r in json.loads(manifest.read_text())["runs"]]
            found = [path / n for n in names if (path / n / "metrics.jsonl").is_file()]
        else:
            found = sorted(d for d in path.glob("*/") if (d / "metrics.jsonl").is_file()) if path.is_dir() else []
        if not found:
            raise ReportError(
                f"{path / 'metrics.jsonl'} does not exist: pass a run directory (runs/<run.name>) that has "
                "started training, a sweep directory or a folder of run directories"
            )
        runs.extend(found)
    return runs


def default_output(paths: list[Path], run_dirs: list[Path]) -> Path:
    """RUN_DIR/report.png for one run; the sweep's (or folder's) report.png; else the runs' common parent's."""
    if len(run_dirs) == 1:
        return run_dirs[0] / "report.png"
    if len(paths) == 1:
        return paths[0] / "report.png"
    return Path(os.path.commonpath([str(d.resolve().parent) for d in run_dirs])) / "report.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_slurm.report",
        description="Plot runs' loss, accuracy, throughput and learning rate to report.png, with a summary; "
        "several run directories (or a sweep directory) are overlaid in one figure.",
    )
    parser.add_argument("paths", type=Path, nargs="+", metavar="RUN_DIR", help="run, sweep or folder of runs")
    parser.add_argument("--output", type=Path, help="where to write the PNG (default: report.png in the directory)")
    parser.add_argument("--no-accounting", action="store_true", help="do not ask seff/sacct about the Slurm jobs")
    args = parser.parse_args(argv)
    try:
        run_dirs = expand(args.paths)
        runs = [load(d) for d in run_dirs]
    except ReportError as exc:
        print(f"ddp_slurm.report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = args.output or default_output(args.paths, run_dirs)
    lines = [summary(run) for run in runs]
    if not args.no_accounting:
        lines += [jobacct.describe(j) for run in runs for j in jobacct.job_ids(run.run_dir, run.starts)]
    try:
        if len(runs) == 1:
            figures.plot_run(runs[0], out, f"{runs[0].run_dir.name}: {lines[0].splitlines()[0].split(': ', 1)[1]}")
        else:
            names = [str(os.path.relpath(d, out.parent)) if len(args.paths) == 1 else str(d) for d in run_dirs]
            figures.plot_overlay(
                runs, names, out, f"{len(runs)} runs" + (f" of {args.paths[0]}" if len(args.paths) == 1 else "")
            )
    except OSError as exc:
        print(
            f"ddp_slurm.report: error: cannot write {out}: {exc.strerror or exc}; choose another --output",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print("\n".join(lines) + f"\nplots: {out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
