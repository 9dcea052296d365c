"""`ddp-slurm init DIR`: the sbatch scripts and job configs copied, executable, never over a user's file.
(The wheel install that ships them is tests/cluster/test_wheel_cluster.py, which also submits the copy.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, base_env

from ddp_slurm.launch import init


def ddp_slurm(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_slurm", *args], cwd=cwd, env=base_env(), capture_output=True, text=True, timeout=60
    )


def test_init_copies_the_repository_files(tmp_path: Path) -> None:
    res = ddp_slurm("init", "project", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    dest = tmp_path / "project"
    for folder, pattern in init.SHIPPED.items():
        originals = sorted((REPO / folder).glob(pattern))
        assert originals
        for src in originals:
            copy = dest / folder / src.name
            assert copy.read_bytes() == src.read_bytes(), copy
            assert f"wrote project/{folder}/{src.name}" in res.stdout
            if copy.suffix == ".sh":
                assert os.access(copy, os.X_OK)
    assert "sbatch sbatch/mnist_4node.sh" in res.stdout


def test_init_never_overwrites_without_force(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    mine = tmp_path / "jobs" / "mnist.yaml"
    mine.write_text("# my edits\n")
    res = ddp_slurm("init", ".", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--force" in res.stderr
    assert mine.read_text() == "# my edits\n"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["jobs", "jobs/mnist.yaml"]
    assert ddp_slurm("init", ".", "--force", cwd=tmp_path).returncode == 0
    assert mine.read_bytes() == (REPO / "jobs" / "mnist.yaml").read_bytes()


def test_init_writes_nothing_through_links_planted_in_dir(tmp_path: Path) -> None:
    """A dangling link once created a file outside DIR; ``--force`` overwrote a linked victim file and made it
    executable; a linked folder took every file. Now a link is replaced, never followed, and a folder must be
    a real one."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("hers\n")
    victim.chmod(0o600)
    project = tmp_path / "project"
    (project / "jobs").mkdir(parents=True)
    (project / "sbatch").mkdir()
    (project / "jobs" / "mnist.yaml").symlink_to(outside / "created.yaml")  # dangling
    (project / "sbatch" / "mnist_4node.sh").symlink_to(victim)
    res = ddp_slurm("init", "project", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--force" in res.stderr, res.stderr
    assert ddp_slurm("init", "project", "--force", cwd=tmp_path).returncode == 0
    assert not (outside / "created.yaml").exists() and victim.read_text() == "hers\n"
    assert not os.access(victim, os.X_OK)
    for name in ("jobs/mnist.yaml", "sbatch/mnist_4node.sh"):
        assert not (project / name).is_symlink() and (project / name).read_bytes() == (REPO / name).read_bytes()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "sbatch").symlink_to(outside, target_is_directory=True)
    res = ddp_slurm("init", "linked", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "symlink" in res.stderr, res.stderr
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]


def test_init_into_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    res = ddp_slurm("init", "f", cwd=tmp_path)
    assert res.returncode == 2 and "not a directory" in res.stderr


def test_asset_lookup() -> None:
    assert init.asset("jobs/mnist.yaml").read_bytes() == (REPO / "jobs" / "mnist.yaml").read_bytes()
    assert init.asset_dir("sbatch") in (REPO / "sbatch", Path(init.__file__).parents[1] / "assets" / "sbatch")


def test_init_with_a_task_writes_its_job_config_with_the_submit_lines(tmp_path: Path) -> None:
    """``ddp-slurm init DIR --task line_task.py:Line``: jobs/line.yaml with the task's own sections and the
    runtime's at their defaults, the sbatch lines that submit it, and a file ``--config`` reads back."""
    from tasks_helpers import write_line_task

    from ddp_slurm import config

    write_line_task(tmp_path)
    res = ddp_slurm("init", "project", "--task", "line_task.py:Line", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    job = tmp_path / "project" / "jobs" / "line.yaml"
    text = job.read_text()
    assert f"task: {tmp_path / 'line_task.py'}:Line\n" in text and "\nline:\n" in text and "\nslurm:\n" in text
    assert "\nmodel:\n" not in text  # MNIST's sections are not this task's
    assert "#   sbatch sbatch/mnist_4node.sh --config jobs/line.yaml" in text
    assert "#   sbatch sbatch/mnist_torchrun.sh --config jobs/line.yaml" in text
    assert "sbatch sbatch/mnist_4node.sh --config jobs/line.yaml" in res.stdout.splitlines()[-1]
    assert (tmp_path / "project" / "sbatch" / "mnist_4node.sh").is_file()
    loaded = config.load(job, resolve=False)
    assert (
        loaded.task.endswith("line_task.py:Line") and loaded.slurm.nodes == config.Config(task=loaded.task).slurm.nodes
    )


def test_init_with_a_task_that_cannot_be_used_writes_nothing(tmp_path: Path) -> None:
    res = ddp_slurm("init", "project", "--task", "nowhere.py:Missing", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "nowhere.py" in res.stderr, res.stderr
    assert not (tmp_path / "project").exists()
