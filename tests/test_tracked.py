"""The tools read the metric a task tracks (ddp_slurm/tools/tracked.py), not only ``accuracy``.

The docs' Line task tracks ``mse`` (lower is better). Three real trainings of it make a sweep directory;
``report`` shows the mse and labels its panel with it, ``submit --summary`` ranks the points lowest mse
first, and the overlay of the sweep has an mse panel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Launcher, base_env
from tasks_helpers import LINE_RUN, write_line_task

from ddp_slurm.launch import sweep
from ddp_slurm.tools import figures, report, sweeps, tracked

LRS = ["0.05", "0.5", "0.005"]  # in the manifest in this order; by mse: 0.5, 0.05, 0.005


@pytest.fixture(scope="module")
def line_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tracked")
    write_line_task(tmp)
    root = tmp / "runs" / "line-sweep"
    points = sweep.points([f"train.lr={','.join(LRS)}"])
    sweeps.write(root, sweep.manifest("12345", points, []))
    overrides = [o for o in LINE_RUN if not o.startswith("train.lr=")]
    for point in points:
        cmd = Launcher(tmp).cmd_train(
            "task=line_task.py:Line", *overrides, *point.overrides, f"run.output_root={root}", f"run.name={point.name}"
        )
        Launcher(tmp).run(cmd, check=True)
    return root


def tool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=base_env(), capture_output=True, text=True)


def mse(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["mse"] for r in rows if r["kind"] == "eval"]


def test_start_lines_name_the_tracked_metric(line_sweep: Path) -> None:
    first = json.loads((line_sweep / "lr=0.5" / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["kind"], first["best_metric"], first["higher_is_better"]) == ("start", "mse", False)
    assert first["steps_per_epoch"] == 8 and first["launch"] == 1


def test_report_shows_the_mse_and_labels_the_panel(line_sweep: Path) -> None:
    run_dir = line_sweep / "lr=0.5"
    res = tool("ddp_slurm.report", str(run_dir), "--no-accounting", cwd=line_sweep)
    assert res.returncode == 0, res.stderr
    values = mse(run_dir)
    assert len(values) == 3
    best = values.index(min(values))
    assert (
        f"test mse: final {values[-1]:.4g} (step 24), best {min(values):.4g} (step {8 * (best + 1)}; lower is better)"
        in res.stdout
    ), res.stdout
    assert "accuracy" not in res.stdout and (run_dir / "report.png").is_file()
    fig = figures.build_run(report.read_history(run_dir), "lr=0.5")
    (panel,) = [ax for ax in fig.axes if ax.get_title() == "test mse"]
    assert panel.get_ylabel() == "mse"
    (line,) = [line for line in panel.get_lines() if line.get_label() == "test mse"]
    assert list(line.get_ydata()) == pytest.approx(values)


def test_sweep_summary_ranks_the_lowest_mse_first(line_sweep: Path) -> None:
    res = tool("ddp_slurm.submit", "--summary", str(line_sweep), cwd=line_sweep)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "best first by test mse (lower is better)" in lines[0], res.stdout
    assert lines[1].split()[:8] == ["run", "train.lr", "status", "steps", "final", "mse", "best", "mse"], lines[1]
    best = {lr: min(mse(line_sweep / f"lr={lr}")) for lr in LRS}
    order = sorted(LRS, key=best.__getitem__)
    assert order == ["0.5", "0.05", "0.005"], best  # the three learning rates really do differ
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == [f"lr={lr}" for lr in order]
    assert [r[1] for r in rows] == order  # the swept value column moves with its row
    assert [r[5] for r in rows] == [tracked.show("mse", best[lr]) for lr in order]
    assert "-" not in [r[4] for r in rows]


def test_sweep_overlay_has_an_mse_panel(line_sweep: Path) -> None:
    res = tool("ddp_slurm.report", str(line_sweep), "--no-accounting", cwd=line_sweep)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("test mse: final") == 3 and (line_sweep / "report.png").is_file()
    runs = [report.read_history(line_sweep / f"lr={lr}") for lr in LRS]
    fig = figures.build_overlay(runs, LRS, "sweep")
    (panel,) = [ax for ax in fig.axes if ax.get_title() == "test mse"]
    assert [line.get_label() for line in panel.get_lines()][:3] == LRS and panel.get_ylabel() == "mse"
    assert not [ax for ax in fig.axes if "accuracy" in ax.get_title()]


def test_direction_and_old_files() -> None:
    lower = tracked.Tracked("mse", higher_is_better=False)
    rows = [{"step": 1, "mse": 0.3}, {"step": 2, "mse": 0.1}, {"step": 3, "mse": 0.2}]
    assert lower.best(rows)["step"] == 2 and tracked.Tracked("mse").best(rows)["step"] == 1
    assert sorted([0.3, None, 0.1], key=lower.sort_key) == [0.1, 0.3, None]
    # written before start lines named the metric: accuracy when there is one, else none
    assert tracked.from_rows([{"kind": "start"}], [{"accuracy": 0.9, "loss": 0.1}]) == tracked.Tracked("accuracy")
    assert tracked.from_rows([{"kind": "start"}], [{"mse": 0.9}]) == tracked.Tracked(None)
