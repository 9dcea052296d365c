"""``ddp-slurm export RUN_DIR [--best | --step N] OUT`` and ``ddp_slurm.load_model`` (ddp_slurm/tools/export.py):
what a chosen checkpoint holds, loaded back into the task's model; every refusal one line, nothing overwritten.
The best checkpoint's export under ddp and fsdp, evaluated to the run's best value, is in test_resume.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tasks_helpers
import torch
from conftest import Launcher, base_env

import ddp_slurm
from ddp_slurm.errors import UsageError
from ddp_slurm.safefs import UnsafePath
from ddp_slurm.train import checkpoint


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-rank Line run of 24 steps with checkpoints at 4, 8, ..., 24 and an evaluation per epoch."""
    cwd = tmp_path_factory.mktemp("export")
    tasks_helpers.write_line_task(cwd)
    overrides = [
        "task=line_task.py:Line",
        *tasks_helpers.LINE_RUN,
        "checkpoint.every_steps=4",
        "checkpoint.keep=100",
        "run.name=line",
    ]
    Launcher(cwd).run(Launcher(cwd).cmd_train(*overrides), check=True)
    return cwd / "runs" / "line"


def export(cwd: Path, *args: object) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddp_slurm.export", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=base_env(), capture_output=True, text=True, timeout=300)


def refused(res: subprocess.CompletedProcess, says: str) -> None:
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and says in res.stderr, res.stderr
    assert res.stderr.startswith("ddp-slurm export: error: "), res.stderr


def test_a_chosen_step_is_exported_and_loads_back_into_the_task_s_model(run_dir: Path, tmp_path: Path) -> None:
    res = export(tmp_path, run_dir, "--step", 4, tmp_path / "four")
    assert res.returncode == 0 and "step-4.pt (step 4)" in res.stdout, res.stderr  # mid-epoch: no evaluation
    out = tmp_path / "four"
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "export.json", "model.pt"]
    about = json.loads((out / "export.json").read_text())
    assert (about["step"], about["checkpoint"], about["strategy"], about["evaluation"]) == (4, "step-4.pt", "ddp", None)
    saved = checkpoint.load(run_dir / "checkpoints" / "step-4.pt")["model"]
    plain = torch.load(out / "model.pt", weights_only=True)
    assert plain.keys() == saved.keys() and all(torch.equal(plain[k], saved[k]) for k in saved)
    model = ddp_slurm.load_model(out)
    assert not model.training and all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())

    newest = export(tmp_path, run_dir, tmp_path / "newest")  # no choice: the newest, with its evaluation
    assert newest.returncode == 0 and "(step 24; mse=" in newest.stdout, newest.stderr
    assert json.loads((tmp_path / "newest" / "export.json").read_text())["evaluation"]["step"] == 24


def test_what_cannot_be_exported_is_one_line_and_nothing_is_written(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    refused(export(tmp_path, tmp_path / "nothing", out), "is not a run directory")
    refused(export(tmp_path, run_dir, "--step", 5, out), "no checkpoint of step 5 (steps: 4, 8, 12, 16, 20, 24)")
    refused(export(tmp_path, run_dir, "--step", 8, "--best", out), "not allowed with argument")
    refused(export(tmp_path, run_dir, "--step", "-1", out), "--step")
    assert not out.exists()
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    refused(export(tmp_path, run_dir, out), "exists: give a new folder")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial folder left


def test_best_without_a_best_file_and_a_checkpoint_that_fails_the_gate(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(run_dir), str(copy)], check=True)
    (copy / "best").unlink(missing_ok=True)
    refused(export(tmp_path, copy, "--best", tmp_path / "a"), "has no best checkpoint")
    blob = bytearray((copy / "checkpoints" / "step-12.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (copy / "checkpoints" / "step-12.pt").write_bytes(bytes(blob))
    refused(export(tmp_path, copy, "--step", 12, tmp_path / "b"), "step-12.pt cannot be exported")
    os.chmod(copy / "checkpoints" / "step-16.pt", 0o666)  # writable by everyone: not trusted
    refused(export(tmp_path, copy, "--step", 16, tmp_path / "c"), "writable by every user")
    assert not any((tmp_path / n).exists() for n in "abc")


def test_load_model_refuses_what_is_no_export_of_yours(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is not an export"):
        ddp_slurm.load_model(tmp_path)
    out = tmp_path / "mine"
    assert export(tmp_path, run_dir, out).returncode == 0
    os.chmod(out / "config.yaml", 0o666)  # it names the code load_model imports: anyone could have changed it
    with pytest.raises(UnsafePath, match="writable by every user"):
        ddp_slurm.load_model(out)


def test_a_planted_temporary_folder_is_never_adopted(run_dir: Path, tmp_path: Path) -> None:
    """``.OUT.partial-<pid>`` (mode 777, made by someone else in a shared parent) was once adopted, so OUT ended up
    hers: the temporary is now made exclusively under a name nobody can guess."""
    from ddp_slurm.tools import export as tool

    out = tmp_path / "shared" / "model"
    out.parent.mkdir()
    planted = out.parent / f".{out.name}.partial-{os.getpid()}"
    planted.mkdir()
    planted.chmod(0o777)
    assert tool.main([str(run_dir), str(out)]) == 0
    assert sorted(p.name for p in planted.iterdir()) == [] and out.is_dir() and (out / "model.pt").is_file()
    assert (out.stat().st_mode & 0o777) == 0o750


def test_a_checkpoint_pruned_while_exporting_is_chosen_again(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that is training prunes its older checkpoints (checkpoint.keep): the newest listed can vanish before
    it is read. That once said "cannot write OUT" (5 of 8 exports with keep=1); the newest is chosen again, and a
    step asked for by number that vanished is said to be pruned. The race is replayed in-process: the listing
    returns, then the checkpoint is removed as the run's pruning would remove it."""
    import shutil as sh

    from ddp_slurm.tools import export as tool
    from ddp_slurm.train.checkpoint import gate

    copy = tmp_path / "runs" / "line"
    sh.copytree(run_dir, copy, symlinks=True)
    listed = gate.Gate.candidates
    pruned: list[str] = []

    def prune_after_listing(self: gate.Gate) -> list:
        found = listed(self)
        if not pruned:
            pruned.append("step-24.pt")
            (copy / "checkpoints" / "step-24.pt").unlink()
        return found

    monkeypatch.setattr(gate.Gate, "candidates", prune_after_listing)
    assert tool.main([str(copy), str(tmp_path / "newest")]) == 0
    about = json.loads((tmp_path / "newest" / "export.json").read_text())
    assert about["checkpoint"] == "step-20.pt"
    sh.copy2(run_dir / "checkpoints" / "step-24.pt", copy / "checkpoints" / "step-24.pt")
    pruned.clear()
    assert tool.main([str(copy), "--step", "24", str(tmp_path / "named")]) == 1
    err = capsys.readouterr().err
    assert "step-24.pt was removed while it was being exported" in err and "cannot write" not in err, err
    assert not (tmp_path / "named").exists() and not list(tmp_path.glob(".named.partial-*"))
