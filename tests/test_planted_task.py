"""A run's config names a task file a co-tenant wrote: commands that only read the run never import it.

The planted task leaves a marker file next to itself the moment it is imported (its code ran). ``report``
(one run, a folder of runs, a sweep), ``submit --dry-run`` and ``--summary`` on such a run, ``resume`` of a
run directory it does not trust, and ``config.changes_from`` on a checkpoint's embedded config must each
leave no marker: real files, real processes, a real chown to another user for the foreign case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import base_env, skip_or_fail

from ddp_slurm import config, taskref

OTHER_UID = 65534  # nobody (and its group, nogroup: none of ours)

PLANTED = """
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("the planted task's code ran")

from ddp_slurm.tasks.mnist import MNIST as Evil  # a usable task, so that nothing else stops the import
"""
START = {"kind": "start", "step": 0, "epoch": 0, "time_s": 0.0, "best_metric": "accuracy"}
EVAL = {"kind": "eval", "step": 5, "epoch": 0, "time_s": 1.0, "accuracy": 0.5}
END = {"kind": "end", "step": 5, "epoch": 0, "time_s": 1.5}


@pytest.fixture
def planted(tmp_path: Path) -> tuple[str, Path]:
    """(the task spec a co-tenant's config names, the marker its import would write)."""
    folder = tmp_path / "cotenant"
    folder.mkdir()
    (folder / "evil.py").write_text(PLANTED)
    return f"{folder / 'evil.py'}:Evil", folder / "IMPORTED"


def write_run(run_dir: Path, task: str, metrics: bool = True) -> Path:
    """A run directory as training leaves it, whose config.yaml names ``task``."""
    run_dir.mkdir(parents=True, mode=0o750)
    saved = {"task": task, "run": {"name": run_dir.name}, "train": {"global_batch_size": 32}, "model": {"name": "mlp"}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    if metrics:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (START, EVAL, END)))
    return run_dir


def command(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=base_env(), capture_output=True, text=True, timeout=300
    )


def one_line(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr)
    return lines[0]


def test_report_of_a_run_imports_no_task(tmp_path: Path, planted: tuple[str, Path]) -> None:
    task, marker = planted
    run = write_run(tmp_path / "runs" / "r", task)
    res = command("ddp_slurm.report", str(run), "--no-accounting", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "finished at step 5" in res.stdout
    assert not marker.exists(), "report imported the task a run's config.yaml names"


def test_report_of_a_folder_of_runs_and_of_a_sweep_imports_no_task(tmp_path: Path, planted: tuple[str, Path]) -> None:
    task, marker = planted
    for name in ("a", "b"):
        write_run(tmp_path / "runs" / name, task)
    res = command("ddp_slurm.report", "runs", "--no-accounting", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.count("finished at step 5") == 2, res.stderr
    manifest = {"job_id": "7", "overrides": [], "runs": [{"task": 0, "name": "a", "overrides": []}]}
    (tmp_path / "runs" / "sweep.json").write_text(json.dumps(manifest))
    res = command("ddp_slurm.report", "runs", "--no-accounting", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.count("finished at step 5") == 1, res.stderr
    summary = command("ddp_slurm.submit", "--summary", "runs", cwd=tmp_path)
    assert summary.returncode == 0 and "finished" in summary.stdout, summary.stderr
    assert not marker.exists(), "report or --summary imported the task a run's config.yaml names"


def test_submit_dry_run_of_a_run_directory_naming_a_planted_task(tmp_path: Path, planted: tuple[str, Path]) -> None:
    """The run directory's config names another task: refused in one line, the task named, never imported."""
    task, marker = planted
    write_run(tmp_path / "runs" / "x", task, metrics=False)
    res = command("ddp_slurm.submit", "--dry-run", "run.name=x", cwd=tmp_path)
    line = one_line(res)
    assert "holds a run with another config" in line and f"task: {task!r} -> {taskref.DEFAULT!r}" in line, line
    assert not marker.exists(), "submit --dry-run imported the task a run directory's config.yaml names"


def test_submit_dry_run_imports_not_even_the_users_own_task(tmp_path: Path, planted: tuple[str, Path]) -> None:
    """A dry run shows the task's sections as given and says they are unchecked; a real submit checks them."""
    task, marker = planted
    res = command("ddp_slurm.submit", "--dry-run", "--name", "mine", f"task={task}", "model.name=mlp", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "not checked: a dry run imports no task" in res.stderr and "    name: mlp" in res.stderr
    assert not marker.exists()


@pytest.mark.parametrize("how", ["group-writable", "foreign"])
def test_resume_refuses_a_run_directory_it_cannot_trust_before_importing(
    tmp_path: Path, planted: tuple[str, Path], how: str
) -> None:
    task, marker = planted
    run = write_run(tmp_path / "runs" / "r", task)
    if how == "group-writable":
        run.chmod(0o770)  # a private run (run.shared false) whose directory the group may write
        says = "writable by the group"
    else:
        if os.geteuid() != 0:
            skip_or_fail("giving a run directory to another user needs root")
        for path in (run, *run.iterdir()):
            os.chown(path, OTHER_UID, OTHER_UID)
        says = f"owned by uid {OTHER_UID}"
    res = command("ddp_slurm.resume", str(run), cwd=tmp_path)
    line = one_line(res)
    assert line.startswith("ddp-slurm resume: error: refusing to resume from") and says in line, line
    assert not marker.exists(), "resume imported the task of a run directory it does not trust"
    assert not (run / ".lock").exists() and not (run / "checkpoints").exists()  # nothing started


def test_resume_of_a_foreign_team_run_outside_our_groups_is_refused(tmp_path: Path, planted: tuple[str, Path]) -> None:
    """run.shared=true trusts the group, not everyone: a run owned by another user and group is still refused."""
    if os.geteuid() != 0:
        skip_or_fail("giving a run directory to another user needs root")
    task, marker = planted
    run = write_run(tmp_path / "runs" / "team", task)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump(saved | {"run": {"name": "team", "shared": True}}))
    for path in (run, *run.iterdir()):
        os.chown(path, OTHER_UID, OTHER_UID)
    line = one_line(command("ddp_slurm.resume", str(run), cwd=tmp_path))
    assert "neither yours nor one of your groups" in line, line
    assert not marker.exists()


def test_changes_from_a_checkpoints_config_naming_a_planted_task(planted: tuple[str, Path]) -> None:
    """A checkpoint's embedded config (a dict) naming the planted task: one difference, the task never imported."""
    task, marker = planted
    cfg = config.load(None, ["model.name=mlp"])
    embedded = cfg.to_dict() | {"task": task}
    assert config.changes_from(embedded, cfg, "checkpoint step-10.pt") == [f"task: {task!r} -> {taskref.DEFAULT!r}"]
    assert not marker.exists(), "comparing a checkpoint's config imported the task it names"
