"""``ddp-slurm resume RUN_DIR --step N`` (ddp_slurm/train/rewind.py): the newer checkpoints are set aside, never
deleted, and the run continues from step N to the same end as before; what cannot be resumed moves nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import tasks_helpers
import torch
from conftest import Launcher, base_env
from helpers import resume

from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train import checkpoint
from ddp_slurm.train.rundir import RunLock


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-rank Line run of 24 steps (an evaluation per epoch of 8) with checkpoints every 4 steps,
    written synchronously (checkpoint.async=false, kept by the resumes too): the end of training cancels a
    background write still in flight (step 20, on a loaded machine), and these tests count every step."""
    cwd = tmp_path_factory.mktemp("rewind")
    tasks_helpers.write_line_task(cwd)
    overrides = ["task=line_task.py:Line", *tasks_helpers.LINE_RUN, "checkpoint.every_steps=4", "checkpoint.keep=100"]
    overrides += ["checkpoint.async=false"]
    Launcher(cwd).run(Launcher(cwd).cmd_train(*overrides, "run.name=line"), check=True)
    return cwd / "runs" / "line"


def copy_of(finished: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "line"
    shutil.copytree(finished, run_dir, symlinks=True)
    return run_dir


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_resume_from_a_chosen_step_sets_the_newer_aside_and_ends_as_before(finished: Path, tmp_path: Path) -> None:
    run_dir = copy_of(finished, tmp_path)
    best_before = (run_dir / "best").read_text().strip()
    res = resume(run_dir, "--step", 12)
    assert res.returncode == 0, res.stderr
    [aside] = (run_dir / "set-aside").iterdir()
    assert aside.name.endswith("-after-step-12")
    moved = ["step-16.pt", "step-20.pt", "step-24.pt"]
    assert f"set aside 3 newer checkpoint(s) ({', '.join(moved)}" in res.stderr, res.stderr
    assert "resuming run" in res.stderr and "step 12" in res.stderr
    assert names(aside) == sorted(moved + (["best"] if best_before in moved else []))
    # The run trained 12 -> 24 again, to the same weights and evaluations as the first time.
    again = checkpoint.load(run_dir / "checkpoints" / "step-24.pt")
    first = checkpoint.load(aside / "step-24.pt")
    assert again["finished"] and all(torch.equal(again["model"][k], v) for k, v in first["model"].items())
    assert (run_dir / "best").read_text().strip() == best_before  # the same best, found again
    assert names(run_dir / "checkpoints") == sorted(f"step-{s}.pt" for s in range(4, 25, 4))


def test_what_cannot_be_resumed_moves_nothing(finished: Path, tmp_path: Path) -> None:
    run_dir = copy_of(finished, tmp_path)
    before = names(run_dir / "checkpoints")

    def refused(res: subprocess.CompletedProcess, says: str) -> None:
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and says in res.stderr, res.stderr
        assert names(run_dir / "checkpoints") == before and not (run_dir / "set-aside").exists()

    refused(resume(run_dir, "--step", 5), "has no checkpoint of step 5 (steps: 4, 8, 12, 16, 20, 24)")
    refused(resume(run_dir, "--step", "x"), "expected a step (an integer >= 0), got 'x'")
    blob = bytearray((run_dir / "checkpoints" / "step-12.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (run_dir / "checkpoints" / "step-12.pt").write_bytes(bytes(blob))
    refused(resume(run_dir, "--step", 12), "step-12.pt cannot be resumed")
    lock = RunLock(RunPaths(run_dir))
    lock.acquire()  # a launch training this run
    try:
        refused(resume(run_dir, "--step", 8), "is in use by another launch")
    finally:
        lock.release()
    ranked = base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="localhost")
    ranked["MASTER_PORT"] = "29500"
    refused(resume(run_dir, "--step", 8, env=ranked), "--step: this process is already one rank of a launch")
    finished_line = resume(run_dir, "--step", 24)  # the newest already: nothing moves, the run is finished
    assert finished_line.returncode == 0 and "is the newest checkpoint already" in finished_line.stderr
    assert "already finished" in finished_line.stderr and not (run_dir / "set-aside").exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "oversized"])
def test_a_damaged_best_is_refused_before_anything_moves(finished: Path, tmp_path: Path, kind: str) -> None:
    """A ``best`` that is not a small plain file once gave exit 2 after the newer checkpoints had moved, and a
    plain resume then restarted silently from the older step: every check comes before the first move."""
    run_dir = copy_of(finished, tmp_path)
    before = names(run_dir / "checkpoints")
    best = run_dir / "best"
    best.unlink()
    if kind == "symlink":
        best.symlink_to(run_dir / "checkpoints" / "step-24.pt")
    elif kind == "fifo":
        os.mkfifo(best)
    elif kind == "directory":
        best.mkdir()
    else:
        best.write_text("step-24.pt\n" + "x" * 4096)
    res = resume(run_dir, "--step", 8)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "best" in res.stderr and "nothing was set aside" in res.stderr, res.stderr
    assert names(run_dir / "checkpoints") == before and not (run_dir / "set-aside").exists()


def test_resume_from_a_step_takes_overrides_after_the_flag(finished: Path, tmp_path: Path) -> None:
    """docs/guard.md's manual restart, ``ddp-slurm resume RUN_DIR --step N guard.skip=A-B``, as written:
    overrides after ``--step`` were once refused ("unrecognized arguments")."""
    run_dir = copy_of(finished, tmp_path)
    res = resume(run_dir, "--step", 12, "guard.skip=13-14")
    assert res.returncode == 0, res.stderr
    assert "step 12" in res.stderr and (run_dir / "set-aside").is_dir()
    again = checkpoint.load(run_dir / "checkpoints" / "step-24.pt")
    first = checkpoint.load(next((run_dir / "set-aside").iterdir()) / "step-24.pt")
    # steps 13-14 skipped: the run ends elsewhere than the one that trained them
    assert again["finished"] and not all(torch.equal(again["model"][k], v) for k, v in first["model"].items())
