"""`report` with several runs: a folder of runs and a sweep directory overlaid in one figure; epoch
boundaries, learning rate and world-size changes found in the metrics; one `seff`/`sacct` line per job.

The runs here are metrics.jsonl files with the fields training writes (``lr``, ``world_size``,
``job_id``), written directly so that a world-size change and a learning-rate schedule are present
without a multi-node run. Accounting: the test cluster keeps none, so ``seff``/``sacct`` are small
scripts on PATH printing what those tools print (a stand-in: nothing else can produce their output
here); the real ``sacct`` without accounting is used where it is installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import base_env

from ddp_slurm.tools import figures, jobacct, report

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(
    run_dir: Path,
    lr: float,
    world_sizes: tuple[int, int] = (2, 2),
    job_id: str | None = None,
    steps_per_epoch: bool = False,
    evals: bool = True,
    spike_at: int | None = None,
) -> Path:
    """40 steps, 10 per epoch, logged every 5; a second launch at step 20 with world_sizes[1]. The start
    lines name the steps per epoch with ``steps_per_epoch`` (as training writes them now); ``spike_at``:
    one logged window 100 times faster than the rest (a clock jump)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("train:\n  global_batch_size: 64\n")
    rows = []
    for launch, (first, last) in enumerate([(0, 20), (20, 40)]):
        ws = world_sizes[launch]
        rows.append(
            {"kind": "start", "step": first, "epoch": first // 10, "time_s": first * 0.1, "world_size": ws}
            | ({"job_id": job_id, "restart_count": launch} if job_id else {})
            | ({"steps_per_epoch": 10} if steps_per_epoch else {})
        )
        for step in range(first + 5, last + 1, 5):
            epoch = (step - 1) // 10
            rows.append(
                {
                    "kind": "train",
                    "step": step,
                    "epoch": epoch,
                    "time_s": step * 0.1,
                    "loss": 2.0 / step**0.5,
                    "samples_per_s": 1000.0 * ws * (100 if step == spike_at else 1),
                    "world_size": ws,
                    "lr": lr * (1 - step / 50),
                }
            )
            if step % 10 == 0 and evals:
                rows.append({"kind": "eval", "step": step, "epoch": epoch, "time_s": step * 0.1, "accuracy": step / 50})
    rows.append({"kind": "end", "step": 40, "epoch": 3, "time_s": 4.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_marks_found_in_the_metrics(tmp_path: Path) -> None:
    run = report.read_history(write_run(tmp_path / "r", 1e-3, world_sizes=(2, 4), steps_per_epoch=True))
    assert figures.epoch_boundaries(run) == [10, 20, 30]  # where epochs 2, 3 and 4 began
    assert figures.world_size_changes(run) == [(20, 2.0, 2, 4)]
    assert figures.world_size_changes(report.read_history(write_run(tmp_path / "same", 1e-3))) == []


def test_epoch_boundaries_of_files_without_steps_per_epoch(tmp_path: Path) -> None:
    """Older files: each epoch's evaluation marks its end exactly; without evaluations, the first logged
    step of the next epoch is the best there is."""
    assert figures.epoch_boundaries(report.read_history(write_run(tmp_path / "old", 1e-3))) == [10, 20, 30]
    assert figures.epoch_boundaries(report.read_history(write_run(tmp_path / "bare", 1e-3, evals=False))) == [
        15,
        25,
        35,
    ]


def test_epoch_boundary_lines_are_drawn_at_the_boundary(tmp_path: Path) -> None:
    run = report.read_history(write_run(tmp_path / "r", 1e-3, steps_per_epoch=True))
    fig = figures.build_run(run, "r")
    loss = fig.axes[0]
    drawn = sorted(line.get_xdata()[0] for line in loss.get_lines() if line.get_color() == "tab:olive")
    assert drawn == [64 * 10, 64 * 20, 64 * 30]  # samples seen at steps 10, 20, 30 (global batch 64)


def test_overlay_marks_each_epoch_boundary_once(tmp_path: Path) -> None:
    runs = [
        report.read_history(write_run(tmp_path / f"lr={lr}", lr, steps_per_epoch=True)) for lr in (1e-3, 4e-3, 1.6e-2)
    ]
    at = [runs[0].samples(step) for step in (10, 20, 30)]
    assert figures.overlay_epoch_boundaries(runs, by_samples=True) == at
    assert figures.overlay_epoch_boundaries(runs, by_samples=False) == [10, 20, 30]


def test_a_throughput_spike_does_not_flatten_the_others(tmp_path: Path) -> None:
    """One window at 100x the rate: the axis is scaled to the rest and the title counts the spike."""
    runs = [
        report.read_history(write_run(tmp_path / "a", 1e-3, spike_at=25)),
        report.read_history(write_run(tmp_path / "b", 4e-3)),
    ]
    for fig in (figures.build_overlay(runs, ["a", "b"], "two"), figures.build_run(runs[0], "a")):
        (rate,) = [ax for ax in fig.axes if ax.get_ylabel() == "samples/s"]
        assert rate.get_ylim() == (0, pytest.approx(1.1 * 2000.0))
        assert "1 spike(s) above the axis, up to 200,000" in rate.get_title()
    (rate,) = [ax for ax in figures.build_run(runs[1], "b").axes if ax.get_ylabel() == "samples/s"]
    assert rate.get_ylim()[1] > 2000.0 and "spike" not in rate.get_title()  # nothing to cut: matplotlib's own


def run_report(*args: str, cwd: Path, path_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = base_env()
    if path_dir is not None:
        env["PATH"] = f"{path_dir}:{env['PATH']}"
    return subprocess.run(
        [sys.executable, "-m", "ddp_slurm.report", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_one_run_with_lr_and_world_size_change(tmp_path: Path) -> None:
    write_run(tmp_path / "r", 1e-3, world_sizes=(2, 4))
    res = run_report("r", "--no-accounting", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "r" / "report.png").read_bytes().startswith(PNG)
    assert "finished at step 40, world size 4" in res.stdout


def test_folder_of_runs_overlaid(tmp_path: Path) -> None:
    for lr in ("1e-3", "4e-3", "1.6e-2"):
        write_run(tmp_path / "sweep" / f"lr={lr}", float(lr))
    (tmp_path / "sweep" / "not-a-run").mkdir()
    res = run_report("sweep", "--no-accounting", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "sweep" / "report.png").read_bytes().startswith(PNG)
    assert res.stdout.count("finished at step 40") == 3 and "plots: sweep/report.png" in res.stdout
    # explicit run directories, from anywhere: one figure next to their common parent unless --output
    out = tmp_path / "three.png"
    runs = [str(tmp_path / "sweep" / f"lr={lr}") for lr in ("1e-3", "4e-3")]
    res = run_report(*runs, "--output", str(out), "--no-accounting", cwd=tmp_path / "sweep" / "not-a-run")
    assert res.returncode == 0 and out.read_bytes().startswith(PNG), res.stderr


def test_sweep_manifest_order(tmp_path: Path) -> None:
    sweep = tmp_path / "s"
    for name in ("b", "a"):
        write_run(sweep / name, 1e-3)
    (sweep / "sweep.json").write_text(
        json.dumps({"job_id": "7", "overrides": [], "runs": [{"name": "b"}, {"name": "a"}]})
    )
    assert report.expand([sweep]) == [sweep / "b", sweep / "a"]


def test_empty_folder_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    res = run_report("empty", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "folder of run directories" in res.stderr
    assert list((tmp_path / "empty").iterdir()) == []


SEFF = """Job ID: 41
Cluster: c
User/Group: me/me
State: COMPLETED (exit code 0)
Nodes: 4
Cores per node: 8
CPU Utilized: 01:02:03
CPU Efficiency: 81.20% of 01:16:24 core-walltime
Job Wall-clock time: 00:02:23
Memory Utilized: 1.20 GB (estimated maximum)
Memory Efficiency: 3.75% of 32.00 GB (8.00 GB/node)
"""


def fake_tool(folder: Path, name: str, output: str, code: int = 0) -> None:
    folder.mkdir(exist_ok=True)
    tool = folder / name
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\nexit {code}\n")
    tool.chmod(0o755)


def test_seff_line_per_job(tmp_path: Path) -> None:
    write_run(tmp_path / "r", 1e-3, job_id="41")
    fake_tool(tmp_path / "bin", "seff", SEFF)
    res = run_report("r", cwd=tmp_path, path_dir=tmp_path / "bin")
    assert res.returncode == 0, res.stderr
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("job 41")]
    assert (
        "state COMPLETED (exit code 0)" in line
        and "cpu efficiency 81.20%" in line
        and "memory efficiency 3.75%" in line
    )


def test_sacct_line_when_no_seff(tmp_path: Path) -> None:
    fake_tool(tmp_path / "bin", "sacct", "42|train|COMPLETED|00:05:00|4|cpu=32,mem=64G,node=4|0:0\n")
    line = subprocess.run(
        [sys.executable, "-c", "from ddp_slurm.tools import jobacct; print(jobacct.describe('42'))"],
        env={**base_env(), "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
    ).stdout
    assert line.strip() == "job 42 (sacct): COMPLETED, elapsed 00:05:00, 4 node(s), cpu=32,mem=64G,node=4, exit 0:0"


def test_no_accounting_is_one_line_not_an_error(tmp_path: Path) -> None:
    if shutil.which("sacct") is None:
        assert jobacct.describe("5").endswith("(neither seff nor sacct on PATH)")
        return
    line = jobacct.describe("5")  # this machine's sacct: no accounting storage (or no cluster at all)
    assert line.startswith("job 5") and "\n" not in line


@pytest.mark.parametrize("ids", [["3", "3", "5"]])
def test_job_ids_of_a_run(tmp_path: Path, ids: list[str]) -> None:
    (tmp_path / "submitit" / "9").mkdir(parents=True)
    (tmp_path / "submitit" / "%j").mkdir()
    assert jobacct.job_ids(tmp_path, [{"job_id": i} for i in ids] + [{}]) == ["3", "5", "9"]


def test_a_run_that_logged_its_loss_once_still_shows_it(tmp_path: Path) -> None:
    """A short run (24 steps, logged every 20) has one loss and one lr point: a line of one point draws
    nothing, so it gets a marker, in one run's figure and in an overlay; longer lines stay plain."""
    short = write_run(tmp_path / "short", 1e-3)
    rows = [json.loads(line) for line in (short / "metrics.jsonl").read_text().splitlines()]
    first_train = next(i for i, r in enumerate(rows) if r["kind"] == "train")
    rows = [r for i, r in enumerate(rows) if r["kind"] != "train" or i == first_train]
    (short / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = [report.read_history(short), report.read_history(write_run(tmp_path / "long", 4e-3))]
    for fig in (figures.build_run(runs[0], "short"), figures.build_overlay(runs, ["short", "long"], "two")):
        for ax in fig.axes:
            if ax.get_ylabel() in ("loss", "lr"):
                lone = [line for line in ax.get_lines() if len(line.get_xdata()) == 1]
                longer = [line for line in ax.get_lines() if len(line.get_xdata()) > 1]  # incl. epoch marks
                assert lone and all(line.get_marker() == "o" for line in lone), ax.get_ylabel()
                assert longer and all(line.get_marker() == "None" for line in longer), ax.get_ylabel()


def test_a_metrics_file_that_is_a_symlink_is_refused_in_one_line(tmp_path: Path) -> None:
    """A run never writes its metrics.jsonl as a link: one planted there (to another run's file, or to /dev/zero,
    which would never end) is refused, not followed."""
    write_run(tmp_path / "elsewhere", 1e-3)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").symlink_to(tmp_path / "elsewhere" / "metrics.jsonl")
    res = run_report("r", "--no-accounting", cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "r/metrics.jsonl is a symlink" in lines[0] and not (tmp_path / "r" / "report.png").exists()
    with pytest.raises(report.ReportError, match="symlink"):
        report.read_history(tmp_path / "r")
