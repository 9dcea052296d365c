"""Sweeps for ``python -m ddp_slurm.submit --sweep KEY=V1,V2,...``: their points, names and summary.

A sweep named ``NAME`` lives in ``<output_root>/NAME/``: ``sweep.json`` (what was submitted:
``tools/sweeps.py`` writes and reads it), the submitit logs under ``submitit/`` and one ordinary run directory per point, named after the swept
values (``lr=1e-3``; several ``--sweep`` flags make a grid: ``lr=1e-3,global_batch_size=256``).
Each point is a complete run: it resumes, requeues and reports like any other.

``summarize`` reads a run's ``metrics.jsonl`` (no torch needed) and ``format_table`` lines runs up
side by side; ``python -m ddp_slurm.submit --summary DIR`` prints it for a sweep or a single run.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddp_slurm import text
from ddp_slurm.config import ConfigError
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.tools import sweeps, tracked
from ddp_slurm.train import metrics


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its run name (a directory under the sweep) and the overrides that make it."""

    name: str
    overrides: tuple[str, ...]


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """``"train.lr=1e-3,3e-3"`` -> ``("train.lr", ["1e-3", "3e-3"])``; values are kept as typed."""
    key, sep, raw = spec.partition("=")
    key = key.strip()
    values = [v.strip() for v in raw.split(",")]
    if not sep or "." not in key or not all(values):
        raise ConfigError(f"bad --sweep {spec!r}: expected KEY=V1,V2,... with a dotted key, e.g. train.lr=1e-3,3e-3")
    if len(set(values)) != len(values):
        raise ConfigError(f"bad --sweep {spec!r}: a value is listed twice")
    return key, values


def _safe(text: str) -> str:
    """A value as it may appear in a directory name (no '/', no spaces or shell-special characters)."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def points(specs: Iterable[str]) -> list[Point]:
    """The grid of all ``--sweep`` flags (one flag: one point per value), in the order given."""
    axes = [parse_sweep(s) for s in specs]
    keys = [k for k, _ in axes]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--sweep names the same key twice ({', '.join(keys)}): list all its values in one flag")
    short = [k.rsplit(".", 1)[1] for k in keys]
    labels = short if len(set(short)) == len(short) else keys  # full keys only where the short ones clash
    out = []
    for combo in itertools.product(*(values for _, values in axes)):
        name = ",".join(f"{label}={_safe(v)}" for label, v in zip(labels, combo))
        out.append(Point(name, tuple(f"{k}={v}" for k, v in zip(keys, combo))))
    if len({p.name for p in out}) != len(out):
        raise ConfigError(
            "--sweep values differ only in characters a directory name cannot hold: "
            "use values that differ in letters, digits, '.', '+' or '-'"
        )
    return out


def manifest(job_id: str, pts: list[Point], base_overrides: list[str]) -> sweeps.Manifest:
    """What ``sweep.json`` records: the job and, per array task, the run it trains."""
    runs = tuple(sweeps.Entry(i, p.name, p.overrides) for i, p in enumerate(pts))
    return sweeps.Manifest(job_id, tuple(base_overrides), runs)


@dataclass
class RunSummary:
    """Where a run stands, from its metrics.jsonl."""

    name: str
    run_dir: str
    status: str  # "pending" (nothing written yet), "running", "stopped", "finished"
    step: int = 0
    epoch: int = 0
    metric: str | None = None  # the task's best_metric, from the start lines
    higher_is_better: bool = True
    percent: tuple[str, ...] | None = None  # the task's percent_metrics (None: the default rule)
    final: float | None = None  # the metric at the last evaluation
    best: float | None = None  # its best value, in its direction
    early_stop: int | None = None  # the step early stopping ended the run at (eval.patience)
    restarts: int = 0  # launches after the first (requeues and relaunches)
    time_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(run_dir: Path, name: str | None = None) -> RunSummary:
    """Read ``run_dir/metrics.jsonl``: status, last step, the tracked metric's last and best value, launches."""
    run_dir = Path(run_dir)
    out = RunSummary(name or run_dir.name, str(run_dir), "pending")
    path = RunPaths(run_dir).metrics
    if not path.is_file() or path.is_symlink():  # none yet; or planted (a FIFO would block, /dev/zero never end)
        return out
    starts: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for row in metrics.read(path):
        kind = row.get("kind")
        out.step, out.epoch, out.time_s = row.get("step", out.step), row.get("epoch", out.epoch), row.get("time_s", 0.0)
        if kind == "start":
            starts.append(row)
            out.status, out.early_stop = "running", None
        elif kind == "eval":
            evals.append(row)
        elif kind == "stop":
            out.status = "stopped"
        elif kind == "early_stop":
            out.early_stop = row.get("step")
        elif kind == "end":
            out.status = "finished"
    out.restarts = max(0, len(starts) - 1)
    metric = tracked.from_rows(starts, evals)
    out.metric, out.higher_is_better, out.percent = metric.name, metric.higher_is_better, metric.percent
    scored = [r for r in evals if metric.name and tracked.is_number(r.get(metric.name))]
    if scored and metric.name:
        out.final = scored[-1][metric.name]
        out.best = (metric.best(scored) or {}).get(metric.name)
    return out


def ranked(rows: list[RunSummary]) -> list[int]:
    """The rows' indices, best run first in its metric's direction (runs without a value last, in order)."""
    return sorted(
        range(len(rows)), key=lambda i: tracked.Tracked(rows[i].metric, rows[i].higher_is_better).sort_key(rows[i].best)
    )


def format_table(rows: list[RunSummary], columns: dict[str, list[str]] | None = None) -> str:
    """Runs side by side; ``columns`` adds one column per swept key (header -> value per row)."""
    columns = columns or {}
    names = {r.metric for r in rows if r.metric}
    what = f" {names.pop()}" if len(names) == 1 else ""
    header = ["run", *columns, "status", "steps", f"final{what}", f"best{what}", "restarts", "time"]
    body = [
        [
            r.name,
            *(vals[i] for vals in columns.values()),
            f"stopped early at {r.early_stop}" if r.status == "finished" and r.early_stop is not None else r.status,
            str(r.step),
            tracked.show(r.metric or "", r.final, r.percent) + ("" if what or r.metric is None else f" {r.metric}"),
            tracked.show(r.metric or "", r.best, r.percent) + ("" if what or r.metric is None else f" {r.metric}"),
            str(r.restarts),
            f"{r.time_s:.0f}s",
        ]
        for i, r in enumerate(rows)
    ]
    return "\n".join(text.columns([header, *body]))


def summary_text(path: Path) -> str:
    """The table for a sweep directory (with ``sweep.json``) or a single run directory. A damaged manifest:
    UsageError (one line)."""
    path = Path(path)
    found = sweeps.read(path)
    if found is not None:
        keys = sweeps.swept_keys(found)
        columns = {k: [r.overrides[i].partition("=")[2] for r in found.runs] for i, k in enumerate(keys)}
        rows = [summarize(path / r.name, r.name) for r in found.runs]
        order = ranked(rows)
        rows = [rows[i] for i in order]
        columns = {k: [vals[i] for i in order] for k, vals in columns.items()}
        head = f"sweep {path} (job {found.job_id}, {len(rows)} runs)"
        metric = next((r for r in rows if r.metric), None)
        if metric is not None:
            way = "lower" if not metric.higher_is_better else "higher"
            head += f", best first by test {metric.metric} ({way} is better)"
        return head + "\n" + format_table(rows, columns)
    if RunPaths(path).is_run():
        return format_table([summarize(path)])
    raise ConfigError(
        f"{path} is neither a sweep directory (no {RunPaths(path).sweep.name}) nor a run directory (no config.yaml)"
    )
