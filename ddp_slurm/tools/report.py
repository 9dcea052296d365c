"""``python -m ddp_slurm.report RUN_DIR [RUN_DIR ...]``: plots to ``report.png`` and a short summary.

Reading runs imports nothing they name: a run's ``config.yaml`` is read for its runtime keys only
(``config.read_resolved``), never for the task file it names, which a co-tenant could have written.

One run directory: its loss, eval metrics, throughput and learning rate in detail (``RUN_DIR/report.png``).
Several, a sweep directory or a folder of runs: overlaid in one figure. For runs that ran as Slurm
jobs, one line per job from ``seff`` or ``sacct`` where the cluster keeps accounting.

Reads ``metrics.jsonl`` (see :mod:`ddp_slurm.train.metrics`) of a finished run, a stopped one or one that
is still being written (a half-written last line is skipped). Each launch writes a ``start`` line at
the step it resumed from; steps after that point logged by an earlier launch were redone, so they
are dropped and the later launch's values kept (so are the steps the guard redid after a rollback).
Restarts, stop signals and the guard's rollbacks and skipped steps are marked on the plots; each
rollback is a line of the summary, with its replay's verdict.
The history is read by :mod:`ddp_slurm.tools.history`, the figures drawn by :mod:`ddp_slurm.tools.figures`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from ddp_slurm.config import relaunch
from ddp_slurm.errors import UsageError
from ddp_slurm.exitcodes import EXIT_OK, EXIT_USAGE
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.tools import figures, jobacct, rollbacks, sweeps, tracked
from ddp_slurm.tools.history import ReportError, RunHistory, eval_metrics, read_history

__all__ = ["ReportError", "RunHistory", "default_output", "eval_metrics", "expand", "main", "read_history", "summary"]


MAX_LISTED = 12
"""Eval metrics whose final value the summary lists; the count of the others follows."""


def summary(run: RunHistory) -> str:
    """The text summary: status, the tracked metric (final and best, in its direction) and the other
    eval metrics' final values, time, restarts, the guard's rollbacks (one line each), mean throughput."""
    last = run.last or {}
    if run.ended and run.early_stop is not None:
        status = f"stopped early at step {run.early_stop['step']} ({run.early_stop.get('reason', 'eval.patience')})"
    elif run.ended:
        status = f"finished at step {last['step']}"
    elif last.get("kind") == "stop":
        status = f"stopped on a signal at step {last['step']} (resume: {relaunch.resume_command(run.run_dir)})"
    else:
        status = f"running or interrupted, last line at step {last['step']}"
    world = next((r.get("world_size") for r in reversed(run.starts + run.train) if r.get("world_size")), None)
    lines = [f"run {run.run_dir}: {status}" + (f", world size {world}" if world else "")]
    name, best = run.metric.name, run.metric.best(run.evals)
    if best is not None and name:
        final = next(r for r in reversed(run.evals) if name in r)
        lines.append(
            f"test {name}: final {tracked.show(name, final[name], run.metric.percent)} (step {final['step']}), "
            f"best {tracked.show(name, best[name], run.metric.percent)} (step {best['step']}; {run.metric.direction})"
        )
    elif name:
        lines.append(f"test {name}: no evaluation yet")
    others = [n for n in eval_metrics(run) if n != name]
    if others and run.evals:
        listed = others[:MAX_LISTED]
        shown = ", ".join(f"{n} {tracked.show(n, run.evals[-1].get(n), run.metric.percent)}" for n in listed)
        more = f" and {len(others) - len(listed)} more" if len(others) > len(listed) else ""
        lines.append(f"final test {shown}{more} (step {run.evals[-1]['step']})")
    drawn = figures.all_metric_panels([run])
    if len(drawn) > figures.MAX_METRIC_PANELS:
        lines.append(
            f"plots: the first {figures.MAX_METRIC_PANELS} of {len(drawn)} eval metrics (every value is in "
            f"{RunPaths(run.run_dir).metrics.name})"
        )
    launches = len(run.starts)
    requeues = max((r.get("restart_count", 0) for r in run.starts), default=0)
    inside = sum(1 for r in run.starts if r.get("restart_in_allocation"))  # the batch script's relaunches
    lines.append(
        f"wall time: {last.get('time_s', 0.0):.1f} s of training; {launches} launch(es), "
        f"{max(launches - 1, 0)} restart(s) ({inside} inside the allocation after a lost node), "
        f"{requeues} Slurm requeue(s), {len(run.stops)} stop signal(s)"
    )
    lines += [rollbacks.describe(r) for r in run.rollbacks]
    rates = [r["samples_per_s"] for r in run.train if r.get("samples_per_s")]
    if rates:
        lines.append(f"throughput: mean {statistics.fmean(rates):,.0f} samples/s over {len(rates)} logged windows")
    return "\n".join(lines)


def expand(paths: list[Path]) -> list[Path]:
    """Run directories to report on: each path is a run directory (has metrics.jsonl), a sweep
    directory (its runs, in sweep.json's order) or a folder of run directories (each that has started)."""
    runs: list[Path] = []
    for path in paths:
        if RunPaths(path).metrics.is_file():
            runs.append(path)
            continue
        manifest = sweeps.read(path)  # a damaged one: UsageError, one line
        if manifest is not None:
            found = [path / r.name for r in manifest.runs if RunPaths(path / r.name).metrics.is_file()]
        else:
            found = sorted(d for d in path.glob("*/") if RunPaths(d).metrics.is_file()) if path.is_dir() else []
        if not found:
            raise ReportError(
                f"{RunPaths(path).metrics} does not exist: pass a run directory (runs/<run.name>) that has "
                "started training, a sweep directory or a folder of run directories"
            )
        runs.extend(found)
    return runs


def default_output(paths: list[Path], run_dirs: list[Path]) -> Path:
    """RUN_DIR/report.png for one run; the sweep's (or folder's) report.png; else the runs' common parent's."""
    if len(run_dirs) == 1:
        return RunPaths(run_dirs[0]).report
    if len(paths) == 1:
        return RunPaths(paths[0]).report
    return RunPaths(Path(os.path.commonpath([str(d.resolve().parent) for d in run_dirs]))).report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_slurm.report",
        description="Plot runs' loss, eval metrics, throughput and learning rate to report.png, with a summary; "
        "several run directories (or a sweep directory) are overlaid in one figure.",
    )
    parser.add_argument("paths", type=Path, nargs="+", metavar="RUN_DIR", help="run, sweep or folder of runs")
    parser.add_argument("--output", type=Path, help="where to write the PNG (default: report.png in the directory)")
    parser.add_argument("--no-accounting", action="store_true", help="do not ask seff/sacct about the Slurm jobs")
    args = parser.parse_args(argv)
    try:
        run_dirs = expand(args.paths)
        runs = [read_history(d) for d in run_dirs]
    except UsageError as exc:  # ReportError among them
        print(f"ddp_slurm.report: error: {exc}", file=sys.stderr)
        return exc.exit_code
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
