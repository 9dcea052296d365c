"""The figures of ``ddp-slurm report``: one run in detail, or several runs (a sweep) overlaid.

Panels: training loss (and test loss), one panel per evaluation metric (the task's ``best_metric``
first, labelled with its name: ``accuracy (%)``, ``mse``, ...) against samples seen, throughput against
training time and, when the metrics carry ``lr``, the learning rate. Marked on them: restarts (red
after a Slurm requeue), stop signals, epoch boundaries (at the step each epoch began), changes of
the world size between launches and, on one run's loss, the guard's rollbacks and skipped steps. The
throughput axis ignores spikes (a first window after a restart, a clock jump): its top is set from the
bulk of the points and the points above it are counted in the title. matplotlib's object API on an Agg canvas: no display, no pyplot state.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ddp_slurm import safefs
from ddp_slurm.tools import rollbacks, tracked
from ddp_slurm.tools.history import RunHistory, eval_metrics


def _figure(panels: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.3 * panels), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1)
    return fig, list(axes) if panels > 1 else [axes]


def _save(fig: Any, out: Path) -> Path:
    # Atomic (a reader, or a browser refreshing it, never sees half a file) and never through a symlink.
    safefs.write_atomic(out, lambda f: fig.savefig(f, format="png"))
    return out


def epoch_boundaries(run: RunHistory) -> list[int]:
    """The step at which each epoch after the first began: multiples of the run's steps per epoch (from
    its start lines) up to the last epoch it reached. Files written before start lines said: each
    epoch's evaluation (it runs at the epoch's last step), else the first logged step of the next epoch."""
    reached = max((r.get("epoch", 0) for r in run.train), default=0)
    if run.steps_per_epoch:
        return [k * run.steps_per_epoch for k in range(1, reached + 1)]
    at_eval = {r.get("epoch", 0): r["step"] for r in run.evals}
    if all(e in at_eval for e in range(reached)):
        return [at_eval[e] for e in range(reached)]
    steps, previous = [], None
    for row in run.train:
        if previous is not None and row.get("epoch", 0) > previous:
            steps.append(row["step"])
        previous = row.get("epoch", 0)
    return steps


def overlay_epoch_boundaries(runs: list[RunHistory], by_samples: bool) -> list[float]:
    """Where the runs' epoch boundaries fall on an overlay's x axis (samples seen, or steps), each
    position once: the runs of a sweep share theirs."""
    return sorted({run.samples(step) if by_samples else step for run in runs for step in epoch_boundaries(run)})


MAX_METRIC_PANELS = 8
"""Eval metrics drawn, each a panel: a task logging hundreds once cost minutes and gigabytes of figure; the rest
stay in metrics.jsonl, and the summary says how many were left out."""


def all_metric_panels(runs: list[RunHistory]) -> list[str]:
    """Every eval metric of the runs (the first run's tracked metric first), but the test loss, which is
    drawn with the training loss."""
    names: dict[str, None] = {}
    for run in runs:
        names.update({n: None for n in eval_metrics(run) if n != "loss"})
    return list(names)


def metric_panels(runs: list[RunHistory]) -> list[str]:
    """The eval metrics that get a panel: the first ``MAX_METRIC_PANELS`` of ``all_metric_panels``."""
    return all_metric_panels(runs)[:MAX_METRIC_PANELS]


def robust_top(values: list[float]) -> tuple[float, int] | None:
    """``(top, points above it)`` when a few values stand far above the rest (beyond the upper quartile
    plus three interquartile ranges), so that they do not flatten the others; None when none does."""
    if len(values) < 4:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4)
    fence = q3 + 3 * max(q3 - q1, 0.05 * abs(q3))
    kept = [v for v in values if v <= fence]
    above = len(values) - len(kept)
    return (1.1 * max(kept), above) if above and kept else None


def _rate_limits(ax: Any, values: list[float], title: str) -> None:
    limits = robust_top(values)
    if limits is None:
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        return
    top, above = limits
    ax.set_ylim(0, top)
    ax.set_title(f"{title} ({above} spike(s) above the axis, up to {max(values):,.0f})")


def world_size_changes(run: RunHistory) -> list[tuple[int, float, int, int]]:
    """``(step, time_s, old, new)`` where a launch ran with another world size than the launch before
    (each launch's size from its ``start`` line, else from its first ``train`` line)."""
    sizes: list[tuple[int, float, int | None]] = []
    for i, start in enumerate(run.starts, 1):
        first = next((r for r in run.train if r.get("launch") == i), {})
        sizes.append((start["step"], start.get("time_s", 0.0), start.get("world_size", first.get("world_size"))))
    changes = []
    for (_, _, old), (step, time_s, new) in zip(sizes, sizes[1:]):
        if old is not None and new is not None and old != new:
            changes.append((step, time_s, old, new))
    return changes


def _style(axes: list[Any], ax_rate: Any, x_label: str) -> None:
    from matplotlib.ticker import FuncFormatter

    thousands = FuncFormatter(lambda x, _: f"{x:,.0f}")
    ax_rate.yaxis.set_major_formatter(thousands)  # samples/s; its x axis is seconds, left as matplotlib has it
    for ax in axes:
        if ax is not ax_rate:
            ax.xaxis.set_major_formatter(thousands)
            ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="best", fontsize="small")


def _log_loss(ax: Any, runs: list[RunHistory]) -> None:
    from matplotlib.ticker import FuncFormatter

    losses = [r["loss"] for run in runs for r in run.train]
    if losses and min(losses) > 0:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))  # 0.3, not 3x10^-1
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if f"{y:e}"[0] in "235" else ""))


def _layout(runs: list[RunHistory]) -> tuple[Any, dict[str, Any], list[str]]:
    """The figure and its panels: ``loss``, one per eval metric (names returned), ``rate``, ``lr`` (when
    the runs log it); the sample-axis panels share their x axis."""
    metrics = metric_panels(runs)
    has_lr = any("lr" in r for run in runs for r in run.train)
    fig, axes = _figure(2 + len(metrics) + has_lr)
    panels = {"loss": axes[0], **{f"metric:{m}": ax for m, ax in zip(metrics, axes[1:])}}
    panels["rate"] = axes[1 + len(metrics)]
    if has_lr:
        panels["lr"] = axes[-1]
    for key, ax in panels.items():
        if key not in ("loss", "rate"):
            ax.sharex(panels["loss"])
        if key.startswith("metric:"):
            name = key.partition(":")[2]
            ax.set(title=f"test {name}", ylabel=tracked.axis_label(name, runs[0].metric.percent))
    return fig, panels, metrics


def _sample_axes(panels: dict[str, Any]) -> list[Any]:
    return [ax for key, ax in panels.items() if key != "rate"]


def _series(ax: Any, xs: list[float], ys: list[float], **style: Any) -> None:
    """A line; a lone point (a short run logs its loss and lr once) gets a marker, or it would not show."""
    ax.plot(xs, ys, marker="o" if len(xs) == 1 else None, **style)


def build_run(run: RunHistory, title: str) -> Any:
    """One run in detail (see the module docstring): the Figure, unsaved."""
    fig, panels, metrics = _layout([run])
    ax_loss, ax_rate = panels["loss"], panels["rate"]
    xs = [run.samples(r["step"]) for r in run.train]
    _series(ax_loss, xs, [r["loss"] for r in run.train], color="tab:blue", label="training loss")
    test_loss = [(run.samples(r["step"]), r["loss"]) for r in run.evals if "loss" in r]
    if test_loss:
        ax_loss.plot(*zip(*test_loss), "o--", color="tab:orange", label="test loss")
    _log_loss(ax_loss, [run])
    rollbacks.draw(ax_loss, run.rollbacks, run.samples)
    ax_loss.set(title="loss", ylabel="loss")
    for i, name in enumerate(metrics):
        rows = [r for r in run.evals if tracked.is_number(r.get(name))]
        panels[f"metric:{name}"].plot(
            [run.samples(r["step"]) for r in rows],
            [tracked.scale(name, r[name], run.metric.percent) for r in rows],
            "o-",
            color=f"C{2 + i}",
            label=f"test {name}",
        )
        best = run.metric.best(rows) if name == run.metric.name else None
        if best is not None:  # the best checkpoint's evaluation (kept as <run dir>/best)
            panels[f"metric:{name}"].plot(
                [run.samples(best["step"])],
                [tracked.scale(name, best[name], run.metric.percent)],
                "*",
                color="gold",
                markeredgecolor="black",
                markersize=14,
                label=f"best (step {best['step']})",
            )
    for launch in sorted({r["launch"] for r in run.train}):  # one line per launch: no line across a restart
        rows = [r for r in run.train if r["launch"] == launch]
        ax_rate.plot(
            [r["time_s"] for r in rows],
            [r.get("samples_per_s") or 0 for r in rows],
            ".-",
            color="tab:purple",
            label="samples/s (all ranks)" if launch == run.train[0]["launch"] else None,
        )
    ax_rate.set(xlabel="training time (s)", ylabel="samples/s")
    _rate_limits(ax_rate, [r.get("samples_per_s") or 0 for r in run.train], "throughput")
    if "lr" in panels:
        rows = [r for r in run.train if "lr" in r]
        _series(
            panels["lr"], [run.samples(r["step"]) for r in rows], [r["lr"] for r in rows], color="tab:brown", label="lr"
        )
        panels["lr"].set(title="learning rate", ylabel="lr")
    _mark(run, _sample_axes(panels), ax_rate)
    _style(list(panels.values()), ax_rate, "samples seen" if run.batch_size else "steps")
    fig.suptitle(title)
    return fig


def plot_run(run: RunHistory, out: Path, title: str) -> Path:
    return _save(build_run(run, title), out)


def _mark(run: RunHistory, sample_axes: list[Any], ax_rate: Any) -> None:
    """Restarts, stop signals, epoch boundaries, an early stop and world-size changes as vertical lines."""
    labelled: set[str] = set()

    def line(x_samples: float, x_time: float | None, color: str, style: str, name: str) -> None:
        label = None if name in labelled else name
        labelled.add(name)
        for ax in sample_axes:
            ax.axvline(x_samples, color=color, linestyle=style, linewidth=1, label=label)
        if x_time is not None:
            ax_rate.axvline(x_time, color=color, linestyle=style, linewidth=1, label=label)

    for i, start in enumerate(run.starts[1:], 1):
        requeued = start.get("restart_count", 0) > run.starts[i - 1].get("restart_count", 0)
        color, name = ("tab:red", "restart (Slurm requeue)") if requeued else ("tab:gray", "restart (resume)")
        line(run.samples(start["step"]), start["time_s"], color, "--", name)
    for stop in run.stops:
        line(run.samples(stop["step"]), stop["time_s"], "black", ":", "stop signal")
    for step in epoch_boundaries(run):
        line(run.samples(step), None, "tab:olive", (0, (1, 4)), "epoch boundary")
    if run.early_stop is not None:
        line(run.samples(run.early_stop["step"]), run.early_stop["time_s"], "tab:green", "-", "early stop")
    for step, time_s, old, new in world_size_changes(run):
        line(run.samples(step), time_s, "tab:cyan", "-.", f"world size {old} -> {new}")


def build_overlay(runs: list[RunHistory], names: list[str], title: str) -> Any:
    """Several runs on the same axes, one colour each (x: samples seen when every run knows its batch)."""
    fig, panels, metrics = _layout(runs)
    ax_loss, ax_rate = panels["loss"], panels["rate"]
    sample_axes = _sample_axes(panels)
    by_samples = all(run.batch_size for run in runs)
    x = lambda run, step: run.samples(step) if by_samples else step  # noqa: E731
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, name, color in zip(runs, names, colors):
        _series(
            ax_loss, [x(run, r["step"]) for r in run.train], [r["loss"] for r in run.train], color=color, label=name
        )
        for metric in metrics:
            rows = [r for r in run.evals if tracked.is_number(r.get(metric))]
            panels[f"metric:{metric}"].plot(
                [x(run, r["step"]) for r in rows],
                [tracked.scale(metric, r[metric], run.metric.percent) for r in rows],
                "o-",
                color=color,
                label=name,
            )
        for launch in sorted({r["launch"] for r in run.train}):
            rows = [r for r in run.train if r["launch"] == launch]
            ax_rate.plot([r["time_s"] for r in rows], [r.get("samples_per_s") or 0 for r in rows], ".-", color=color)
        if "lr" in panels:
            rows = [r for r in run.train if "lr" in r]
            _series(panels["lr"], [x(run, r["step"]) for r in rows], [r["lr"] for r in rows], color=color, label=name)
        for step, time_s, old, new in world_size_changes(run):
            for ax in sample_axes:
                ax.axvline(x(run, step), color=color, linestyle="-.", linewidth=1)
            ax_rate.axvline(
                time_s, color=color, linestyle="-.", linewidth=1, label=f"{name}: world size {old} -> {new}"
            )
        for stop in run.stops:
            ax_rate.axvline(stop["time_s"], color=color, linestyle=":", linewidth=1)
    for i, at in enumerate(overlay_epoch_boundaries(runs, by_samples)):
        for ax in sample_axes:
            label = "epoch boundary" if i == 0 and ax is ax_loss else None
            ax.axvline(at, color="tab:olive", linestyle=(0, (1, 4)), linewidth=1, label=label)
    _log_loss(ax_loss, runs)
    ax_loss.set(title="training loss", ylabel="loss")
    stops = " (dotted: stop signals)" if any(run.stops for run in runs) else ""
    ax_rate.set(xlabel="training time (s)", ylabel="samples/s")
    rates = [r.get("samples_per_s") or 0 for run in runs for r in run.train]
    _rate_limits(ax_rate, rates, f"throughput{stops}")
    if "lr" in panels:
        panels["lr"].set(title="learning rate", ylabel="lr")
    _style(list(panels.values()), ax_rate, "samples seen" if by_samples else "steps")
    fig.suptitle(title)
    return fig


def plot_overlay(runs: list[RunHistory], names: list[str], out: Path, title: str) -> Path:
    return _save(build_overlay(runs, names, title), out)
