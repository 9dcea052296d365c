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


def test_init_into_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    res = ddp_slurm("init", "f", cwd=tmp_path)
    assert res.returncode == 2 and "not a directory" in res.stderr


def test_asset_lookup() -> None:
    assert init.asset("jobs/mnist.yaml").read_bytes() == (REPO / "jobs" / "mnist.yaml").read_bytes()
    assert init.asset_dir("sbatch") in (REPO / "sbatch", Path(init.__file__).parents[1] / "assets" / "sbatch")
