"""A wheel, as a user without the repository gets it: `pip wheel` of a fresh copy of the project,
installed into a new virtual environment, ships `ddp-slurm`; `ddp-slurm init DIR` copies the sbatch
scripts and job configs, and `sbatch` of the copied script trains on the test cluster. A second job,
submitted from a directory without jobs/, finds the job config shipped inside the installed package.

The new environment has no pip and no dependencies of its own: torch and the rest come from the
environment running the tests (a .pth line), so nothing is downloaded; the package itself comes only
from the wheel (no PYTHONPATH, no source tree above the submit directory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, fresh_copy

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TINY = ["data.source=sample", "model.name=mlp", "train.max_steps=20", "train.log_every_steps=5", "dist.timeout_s=120"]
ONE_NODE = ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=5"]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, f"{cmd} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


def test_wheel_init_then_sbatch(slurm_cluster, tmp_path: Path) -> None:
    src = fresh_copy(tmp_path / "src")
    # --no-build-isolation: build with this environment's setuptools instead of downloading one
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src])
    (wheel,) = (tmp_path / "dist").glob("ddp_slurm-*.whl")
    env_dir = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", env_dir])
    site = next((env_dir / "lib").glob("python*/site-packages"))
    deps = Path(importlib.util.find_spec("torch").origin).parents[1]
    (site / "deps.pth").write_text(f"{deps}\n")
    run([sys.executable, "-m", "pip", "--python", env_dir / "bin" / "python", "install", "-q", "--no-deps", wheel])

    env = {k: v for k, v in slurm_cluster.env.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    where = run(["python", "-c", "import ddp_slurm; print(ddp_slurm.__file__)"], env=env, cwd=tmp_path).stdout
    assert where.startswith(str(site)), where
    run(["ddp-slurm", "init", "project"], env=env, cwd=tmp_path)
    project = tmp_path / "project"
    for name in ("sbatch/mnist_4node.sh", "sbatch/mnist_torchrun.sh", "jobs/mnist.yaml", "jobs/mnist_sample.yaml"):
        assert (project / name).read_bytes() == (REPO / name).read_bytes(), name

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    submit = lambda cwd, name: slurm_cluster.run(  # noqa: E731
        ["sbatch", "--parsable", *ONE_NODE, project / "sbatch" / "mnist_4node.sh", *TINY, f"run.name={name}"],
        cwd=cwd,
        check=True,
    ).stdout.strip()
    # Submitted with the installed environment on PATH, as a user who activated it would.
    slurm_cluster.env, saved = env, slurm_cluster.env
    try:
        jobs = {"project": submit(project, "from-project"), "elsewhere": submit(elsewhere, "from-elsewhere")}
        for where_from, job in jobs.items():
            state = slurm_cluster.wait(job, timeout=300)
            cwd = project if where_from == "project" else elsewhere
            log = (cwd / f"mnist-4node-{job}.out").read_text()
            assert state == "COMPLETED" and slurm_cluster.exit_code(job) == (0, 0), log
            assert f"python {env_dir / 'bin' / 'python'}" in log
            config = (
                project / "jobs" / "mnist.yaml"
                if where_from == "project"
                else site / "ddp_slurm/assets/jobs/mnist.yaml"
            )
            assert f"config {config};" in log, log
            run_dir = cwd / "runs" / f"from-{where_from}"
            kinds = [json.loads(line)["kind"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert kinds[0] == "start" and kinds[-1] == "end", kinds
    finally:
        slurm_cluster.env = saved
