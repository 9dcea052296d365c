"""``python -m ddp_slurm.report RUN_DIR``: plots of a run to ``RUN_DIR/report.png`` and a short summary.

Reads ``metrics.jsonl`` (see :mod:`ddp_slurm.metrics`) of a finished run, a stopped one or one that
is still being written (a half-written last line is skipped). Each launch writes a ``start`` line at
the step it resumed from; steps after that point logged by an earlier launch were redone, so they
are dropped and the later launch's values kept. Restarts and stop signals are marked on the plots.
matplotlib (Agg, no display needed) is imported only when plotting.
"""

from __future__ import annotations

import argparse
import json
import reprlib
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_slurm import config, safefs
from ddp_slurm.exitcodes import EXIT_OK, EXIT_USAGE


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


def plot(run: Run, out: Path) -> Path:
    """Three panels: training loss and test accuracy against samples seen, throughput against time."""
    # The object API with an Agg canvas: no display needed (login nodes), no global pyplot state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(10, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc, ax_rate = fig.subplots(3, 1)
    ax_acc.sharex(ax_loss)  # loss and accuracy line up sample for sample
    thousands = FuncFormatter(lambda x, _: f"{x:,.0f}")
    x_label = "samples seen" if run.batch_size else "steps"
    xs = [run.samples(r["step"]) for r in run.train]
    ax_loss.plot(xs, [r["loss"] for r in run.train], color="tab:blue", label="training loss")
    test_loss = [(run.samples(r["step"]), r["loss"]) for r in run.evals if "loss" in r]
    if test_loss:
        ax_loss.plot(*zip(*test_loss), "o--", color="tab:orange", label="test loss")
    if run.train and min(r["loss"] for r in run.train) > 0:
        ax_loss.set_yscale("log")
        ax_loss.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))  # 0.3, not 3x10^-1
        ax_loss.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if f"{y:e}"[0] in "235" else ""))
    ax_loss.set(title="loss", xlabel=x_label, ylabel="loss")
    ax_acc.plot(
        [run.samples(r["step"]) for r in run.evals],
        [100 * r["accuracy"] for r in run.evals],
        "o-",
        color="tab:green",
        label="test accuracy",
    )
    ax_acc.set(title="test accuracy", xlabel=x_label, ylabel="accuracy (%)")
    for launch in sorted({r["launch"] for r in run.train}):  # one line per launch: no line across a restart
        rows = [r for r in run.train if r["launch"] == launch]
        ax_rate.plot(
            [r["time_s"] for r in rows],
            [r.get("samples_per_s") or 0 for r in rows],
            ".-",
            color="tab:purple",
            label="samples/s (all ranks)" if launch == run.train[0]["launch"] else None,
        )
    ax_rate.set(title="throughput", xlabel="training time (s)", ylabel="samples/s")
    ax_rate.yaxis.set_major_formatter(thousands)
    ax_rate.set_ylim(bottom=0)
    _mark_launches(run, ax_loss, ax_acc, ax_rate)
    for ax in (ax_loss, ax_acc, ax_rate):
        ax.xaxis.set_major_formatter(thousands)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # nothing to label yet (a run that only started): no warning
            ax.legend(loc="best", fontsize="small")
    fig.suptitle(f"{run.run_dir.name}: {summary(run).splitlines()[0].split(': ', 1)[1]}")
    # Atomic (a reader, or a browser refreshing it, never sees half a file) and never through a symlink.
    safefs.write_atomic(out, lambda f: fig.savefig(f, format="png"))
    return out


def _mark_launches(run: Run, *axes: Any) -> None:
    """Vertical lines where a launch resumed (red: after a Slurm requeue) and where a stop signal came."""
    ax_loss, ax_acc, ax_rate = axes
    labelled: set[str] = set()
    for i, start in enumerate(run.starts[1:], 1):
        requeued = start.get("restart_count", 0) > run.starts[i - 1].get("restart_count", 0)
        color, name = ("tab:red", "restart (Slurm requeue)") if requeued else ("tab:gray", "restart (resume)")
        label = None if name in labelled else name
        labelled.add(name)
        for ax in (ax_loss, ax_acc):
            ax.axvline(run.samples(start["step"]), color=color, linestyle="--", linewidth=1, label=label)
        ax_rate.axvline(start["time_s"], color=color, linestyle="--", linewidth=1, label=label)
    for i, stop in enumerate(run.stops):
        label = "stop signal" if i == 0 else None
        for ax in (ax_loss, ax_acc):
            ax.axvline(run.samples(stop["step"]), color="black", linestyle=":", linewidth=1, label=label)
        ax_rate.axvline(stop["time_s"], color="black", linestyle=":", linewidth=1, label=label)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_slurm.report",
        description="Plot a run's loss, accuracy and throughput to RUN_DIR/report.png.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--output", type=Path, help="where to write the PNG (default: RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    try:
        run = load(args.run_dir)
    except ReportError as exc:
        print(f"ddp_slurm.report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    target = args.output or args.run_dir / "report.png"
    try:
        out = plot(run, target)
    except OSError as exc:
        print(
            f"ddp_slurm.report: error: cannot write {target}: {exc.strerror or exc}; choose another --output",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(f"{summary(run)}\nplots: {out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
