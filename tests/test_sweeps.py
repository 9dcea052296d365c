"""A sweep directory's manifest (ddp_slurm/tools/sweeps.py): written and read back, and every damaged or planted
``sweep.json`` answered by ``report`` and ``submit --summary`` with one line and exit 2, never a traceback, a
hang or unbounded memory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_bounded

from ddp_slurm.tools import sweeps

START = b'{"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0}\n'
GOOD = {"job_id": "7", "overrides": [], "runs": [{"task": 0, "name": "lr=1", "overrides": ["train.lr=1"]}]}


def test_a_manifest_reads_back_as_written(tmp_path: Path) -> None:
    manifest = sweeps.Manifest("7", ("model.name=mlp",), (sweeps.Entry(0, "lr=1", ("train.lr=1",)),))
    sweeps.write(tmp_path / "s", manifest)
    assert sweeps.read(tmp_path / "s") == manifest and sweeps.swept_keys(manifest) == ["train.lr"]
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["runs"][0]["name"] == "lr=1"
    assert sweeps.read(tmp_path) is None  # no manifest: not a sweep
    assert sweeps.read(tmp_path / "s" / "sweep.json") is None  # a file, not a folder


DAMAGED = {
    "not-json": b"{not json",
    "a-list": b"[1, 2]",
    "no-runs": b'{"job_id": "7"}',
    "runs-not-a-list": b'{"job_id": "7", "runs": {"a": 1}}',
    "run-not-an-object": b'{"job_id": "7", "runs": [3]}',
    "name-leaves-the-folder": b'{"job_id": "7", "runs": [{"name": "../../elsewhere"}]}',
    "name-a-number": b'{"job_id": "7", "runs": [{"name": 5}]}',
    "overrides-a-string": b'{"job_id": "7", "runs": [{"name": "a", "overrides": "train.lr=1"}]}',
    "runs-vary-other-keys": json.dumps(
        {"job_id": "7", "runs": [{"name": "a", "overrides": ["train.lr=1"]}, {"name": "b", "overrides": []}]}
    ).encode(),
    "job-id-a-list": b'{"job_id": [7], "runs": []}',
    "deeply-nested": b"[" * 100_000 + b"]" * 100_000,
    "huge": b'{"job_id": "7", "runs": [], "pad": "' + b"x" * (5 << 20) + b'"}',
}
PLANTED = ("fifo", "dev-zero", "directory", "symlink")


@pytest.mark.parametrize("command", ["report", "summary"])
@pytest.mark.parametrize("kind", [*DAMAGED, *PLANTED])
def test_a_damaged_or_planted_manifest_is_one_line(tmp_path: Path, command: str, kind: str) -> None:
    sweep = tmp_path / "sw"
    (sweep / "lr=1").mkdir(parents=True)
    (sweep / "lr=1" / "metrics.jsonl").write_bytes(START)  # a run the sweep's report would otherwise show
    manifest = sweep / "sweep.json"
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "dev-zero":
        manifest.symlink_to("/dev/zero")
    elif kind == "directory":
        manifest.mkdir()
    elif kind == "symlink":  # even to a good manifest elsewhere: nothing the sweep wrote is a link
        (tmp_path / "good.json").write_text(json.dumps(GOOD))
        manifest.symlink_to(tmp_path / "good.json")
    else:
        manifest.write_bytes(DAMAGED[kind])
    argv = (
        ["ddp_slurm.report", "sw", "--no-accounting"]
        if command == "report"
        else ["ddp_slurm.submit", "--summary", "sw"]
    )
    res = run_bounded(tmp_path, *argv, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stdout, res.stderr[-3000:])
    assert "sw/sweep.json" in lines[0] and ("move it away" in lines[0] or "remove it" in lines[0]), lines[0]
    assert res.stdout == "" and not (sweep / "report.png").exists()


@pytest.mark.parametrize("planted", ["fifo", "dev-zero"])
def test_summary_of_a_sweep_whose_run_has_a_planted_metrics_file_says_pending(tmp_path: Path, planted: str) -> None:
    sweep = tmp_path / "sw"
    sweeps.write(sweep, sweeps.Manifest("7", (), (sweeps.Entry(0, "lr=1", ("train.lr=1",)),)))
    (sweep / "lr=1").mkdir()
    metrics = sweep / "lr=1" / "metrics.jsonl"
    if planted == "fifo":
        os.mkfifo(metrics)
    else:
        metrics.symlink_to("/dev/zero")
    res = run_bounded(tmp_path, "ddp_slurm.submit", "--summary", "sw")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1].split()[:3] == ["lr=1", "1", "pending"], res.stdout
