"""The figures of ``ddp-slurm report``: one run in detail, or several runs (a sweep) overlaid.

Panels: training loss (and test loss) and test accuracy against samples seen, throughput against
training time and, when the metrics carry ``lr``, the learning rate. Marked on them: restarts (red
after a Slurm requeue), stop signals, epoch boundaries (to within one logging interval) and changes of
the world size between launches. matplotlib's object API on an Agg canvas: no display, no pyplot state.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_slurm import safefs

if TYPE_CHECKING:
    from ddp_slurm.tools.report import Run


def _figure(panels: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.3 * panels), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(panels, 1))


def _save(fig: Any, out: Path) -> Path:
    # Atomic (a reader, or a browser refreshing it, never sees half a file) and never through a symlink.
    safefs.write_atomic(out, lambda f: fig.savefig(f, format="png"))
    return out


def epoch_boundaries(run: Run) -> list[int]:
    """Steps of the first logged train line of each epoch after the first."""
    steps, previous = [], None
    for row in run.train:
        if previous is not None and row.get("epoch", 0) > previous:
            steps.append(row["step"])
        previous = row.get("epoch", 0)
    return steps


def overlay_epoch_boundaries(runs: list[Run], by_samples: bool) -> list[float]:
    """Where the runs' epoch boundaries fall on an overlay's x axis (samples seen, or steps), each
    position once: the runs of a sweep share theirs."""
    return sorted({run.samples(step) if by_samples else step for run in runs for step in epoch_boundaries(run)})


def world_size_changes(run: Run) -> list[tuple[int, float, int, int]]:
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


def _style(axes: list[Any], x_label: str) -> None:
    from matplotlib.ticker import FuncFormatter

    thousands = FuncFormatter(lambda x, _: f"{x:,.0f}")
    axes[2].yaxis.set_major_formatter(thousands)  # samples/s; its x axis is seconds, left as matplotlib has it
    for ax in axes:
        if ax is not axes[2]:
            ax.xaxis.set_major_formatter(thousands)
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="best", fontsize="small")
    for ax in axes[:2] + axes[3:]:
        ax.set_xlabel(x_label)


def _log_loss(ax: Any, runs: list[Run]) -> None:
    from matplotlib.ticker import FuncFormatter

    losses = [r["loss"] for run in runs for r in run.train]
    if losses and min(losses) > 0:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))  # 0.3, not 3x10^-1
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if f"{y:e}"[0] in "235" else ""))


def plot_run(run: Run, out: Path, title: str) -> Path:
    """One run in detail (see the module docstring)."""
    has_lr = any("lr" in r for r in run.train)
    fig, axes = _figure(4 if has_lr else 3)
    ax_loss, ax_acc, ax_rate = axes[:3]
    ax_acc.sharex(ax_loss)
    xs = [run.samples(r["step"]) for r in run.train]
    ax_loss.plot(xs, [r["loss"] for r in run.train], color="tab:blue", label="training loss")
    test_loss = [(run.samples(r["step"]), r["loss"]) for r in run.evals if "loss" in r]
    if test_loss:
        ax_loss.plot(*zip(*test_loss), "o--", color="tab:orange", label="test loss")
    _log_loss(ax_loss, [run])
    ax_loss.set(title="loss", ylabel="loss")
    ax_acc.plot(
        [run.samples(r["step"]) for r in run.evals],
        [100 * r["accuracy"] for r in run.evals],
        "o-",
        color="tab:green",
        label="test accuracy",
    )
    ax_acc.set(title="test accuracy", ylabel="accuracy (%)")
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
    ax_rate.set_ylim(bottom=0)
    sample_axes = [ax_loss, ax_acc]
    if has_lr:
        ax_lr = axes[3]
        ax_lr.sharex(ax_loss)
        rows = [r for r in run.train if "lr" in r]
        ax_lr.plot([run.samples(r["step"]) for r in rows], [r["lr"] for r in rows], color="tab:brown", label="lr")
        ax_lr.set(title="learning rate", ylabel="lr")
        sample_axes.append(ax_lr)
    _mark(run, sample_axes, ax_rate)
    _style(axes, "samples seen" if run.batch_size else "steps")
    fig.suptitle(title)
    return _save(fig, out)


def _mark(run: Run, sample_axes: list[Any], ax_rate: Any) -> None:
    """Restarts, stop signals, epoch boundaries and world-size changes as vertical lines."""
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
    for step, time_s, old, new in world_size_changes(run):
        line(run.samples(step), time_s, "tab:cyan", "-.", f"world size {old} -> {new}")


def plot_overlay(runs: list[Run], names: list[str], out: Path, title: str) -> Path:
    """Several runs on the same axes, one colour each (x: samples seen when every run knows its batch)."""
    has_lr = any("lr" in r for run in runs for r in run.train)
    fig, axes = _figure(4 if has_lr else 3)
    ax_loss, ax_acc, ax_rate = axes[:3]
    ax_acc.sharex(ax_loss)
    by_samples = all(run.batch_size for run in runs)
    x = lambda run, step: run.samples(step) if by_samples else step  # noqa: E731
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, name, color in zip(runs, names, colors):
        ax_loss.plot([x(run, r["step"]) for r in run.train], [r["loss"] for r in run.train], color=color, label=name)
        ax_acc.plot(
            [x(run, r["step"]) for r in run.evals],
            [100 * r["accuracy"] for r in run.evals],
            "o-",
            color=color,
            label=name,
        )
        for launch in sorted({r["launch"] for r in run.train}):
            rows = [r for r in run.train if r["launch"] == launch]
            ax_rate.plot([r["time_s"] for r in rows], [r.get("samples_per_s") or 0 for r in rows], ".-", color=color)
        if has_lr:
            rows = [r for r in run.train if "lr" in r]
            axes[3].plot([x(run, r["step"]) for r in rows], [r["lr"] for r in rows], color=color, label=name)
        for step, time_s, old, new in world_size_changes(run):
            for ax in [ax_loss, ax_acc] + axes[3:]:
                ax.axvline(x(run, step), color=color, linestyle="-.", linewidth=1)
            ax_rate.axvline(
                time_s, color=color, linestyle="-.", linewidth=1, label=f"{name}: world size {old} -> {new}"
            )
        for stop in run.stops:
            ax_rate.axvline(stop["time_s"], color=color, linestyle=":", linewidth=1)
    for i, at in enumerate(overlay_epoch_boundaries(runs, by_samples)):
        for ax in [ax_loss, ax_acc] + axes[3:]:
            label = "epoch boundary" if i == 0 and ax is ax_loss else None
            ax.axvline(at, color="tab:olive", linestyle=(0, (1, 4)), linewidth=1, label=label)
    _log_loss(ax_loss, runs)
    ax_loss.set(title="training loss", ylabel="loss")
    ax_acc.set(title="test accuracy", ylabel="accuracy (%)")
    stops = " (dotted: stop signals)" if any(run.stops for run in runs) else ""
    ax_rate.set(title=f"throughput{stops}", xlabel="training time (s)", ylabel="samples/s")
    ax_rate.set_ylim(bottom=0)
    if has_lr:
        axes[3].sharex(ax_loss)
        axes[3].set(title="learning rate", ylabel="lr")
    _style(axes, "samples seen" if by_samples else "steps")
    fig.suptitle(title)
    return _save(fig, out)
