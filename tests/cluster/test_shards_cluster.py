"""Sharded data on the real 4-node test cluster: a SIGUSR2 and requeue, then a node lost and the training step
launched again inside the allocation on the 3 nodes left, and every global batch is the one the run left
alone trained on; the state at each change of world size is bit-identical to runs with that schedule.

``sharded``  sbatch/mnist_4node.sh on 4 nodes x 1 rank, the poison task of tests/guard_helpers.py reading its
             4,800 points from 24 shards (``ddp-slurm data write``) with one loader worker per rank, recording
             each rank's sample ids. After two checkpoints: ``scancel --signal=USR2``, so rank 0 checkpoints and
             requeues the job (Restarts=1), which resumes on 4 nodes; after two more, node3 is set DOWN, and the
             supervisor relaunches the step on the 3 nodes left (world size 3) to the end.

``reference``  the run left alone: the same on 4 ranks (torchrun, this machine). The job's global batches equal
             its batches; the job's checkpoint at the requeue's resume equals the reference's at that step;
             the end equals the job resumed by hand at world size 3 from the checkpoint the relaunch took.

Every rank has one CPU, so runs are bit-for-bit repeatable.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cluster.test_faults_cluster import EVERY, REPO, Driver, Job
from conftest import Launcher, base_env
from guard_helpers import global_batches, same_weights, write_poison_task
from helpers import resume

from ddp_slurm.train import checkpoint

pytestmark = pytest.mark.cluster

POINTS = 4800  # 100 global batches of 48: room for a requeue and a relaunch
SHARDED = [
    "task=poison_task.py:Poison",
    "poison.shards=shards",
    "poison.record=true",
    "poison.sleep=0.01",
    "train.epochs=1",
    "train.global_batch_size=48",  # splits over 4 and 3 ranks
    "train.workers=1",
    "train.log_every_steps=1",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep=100",
]
ONE_PER_NODE = ["--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1"]


def write_shards(folder: Path) -> None:
    """The poison task's points, as 24 shards in ``folder/shards`` (beside ``poison_task.py``)."""
    write_poison_task(folder)
    cmd = [sys.executable, "-m", "ddp_slurm.data", "write", "task=poison_task.py:Poison", f"poison.size={POINTS}"]
    cmd += ["--out", "shards", "--shards", "24"]
    done = subprocess.run(cmd, cwd=folder, env=base_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def weights_at(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step-{step}.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def checkpoints(job: Job) -> int:
    return len(checkpoint.list_checkpoints(job.run_dir))


@pytest.fixture(scope="module")
def sharded(slurm_cluster, tmp_path_factory) -> dict[str, Any]:
    d = Driver(slurm_cluster, tmp_path_factory.mktemp("sharded"))
    write_shards(d.workdir)
    job = Job("sharded", d.workdir)
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={job.name}", *SHARDED, f"poison.size={POINTS}"]
    d.submit(job, ["--nodes=4", "--requeue", *ONE_PER_NODE, str(REPO / "sbatch" / "mnist_4node.sh"), *args])
    out: dict[str, Any] = {"job": job}
    try:
        d.wait_for(job, "two checkpoints", lambda: checkpoints(job) >= 2)
        d.cluster.cancel(job.job_id, "--signal=USR2")
        d.wait_for(job, "the requeue", lambda: d.cluster.job_info(job.job_id)["Restarts"] == "1")
        d.wait_for(job, "the requeued launch", lambda: len(job.rows("start")) == 2)
        had = checkpoints(job)
        d.wait_for(job, "two more checkpoints", lambda: checkpoints(job) >= had + 2)
        d.cluster.run(["scontrol", "update", "NodeName=node3", "State=DOWN", "Reason=test"], timeout=30)
        try:
            d.wait_for(job, "the relaunch", lambda: len(job.rows("start")) == 3)
            out["during"] = d.cluster.job_info(job.job_id)
        finally:
            d.cluster.run(["scontrol", "update", "NodeName=node3", "State=RESUME"], timeout=30)
        d.finish(job)
    finally:
        d.cluster.cancel(job.job_id)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded-reference")
    write_shards(folder)
    ref = folder / "runs" / "ref"
    cmd = Launcher(folder).cmd_torchrun(
        4, *SHARDED, f"poison.size={POINTS}", f"run.output_root={ref.parent}", "run.name=ref"
    )
    res = Launcher(folder).run(cmd, env=base_env(OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    return ref


def test_a_requeue_and_a_shrink_to_3_nodes_train_the_global_batches_of_the_run_left_alone(sharded, reference, tmp_path):
    job = sharded["job"]
    assert job.info["JobState"] == "COMPLETED" and job.info["Restarts"] == "1", job.describe()
    assert sharded["during"]["JobState"] == "RUNNING", sharded["during"]
    assert [r["world_size"] for r in job.rows("start")] == [4, 4, 3], job.describe()
    assert job.rows("start")[2]["restart_in_allocation"] == 1, job.describe()  # the relaunch inside the allocation
    requeued, shrunk = (r["step"] for r in job.rows("start")[1:])
    assert job.rows("stop")[0]["step"] == requeued  # the USR2 stop: its checkpoint is the requeued launch's start

    wanted = global_batches(reference, 4, 1)
    assert len(wanted) == POINTS // 48
    steps = global_batches(job.run_dir, 4, 1)[:shrunk] + global_batches(job.run_dir, 3, 1)
    assert steps == wanted

    # through the requeue: the checkpoint the relaunch took equals the reference's at that step, bit for bit
    assert shrunk % EVERY == 0 and weights_at(job.run_dir, shrunk).keys() == weights_at(reference, shrunk).keys()
    assert all(torch.equal(v, weights_at(reference, shrunk)[k]) for k, v in weights_at(job.run_dir, shrunk).items())
    # after the shrink: the end equals the same run resumed by hand at world size 3 from the relaunch's checkpoint
    copy = tmp_path / "runs" / "sharded"
    shutil.copytree(job.run_dir, copy, symlinks=True)
    (copy.parent.parent / "shards").symlink_to(job.workdir / "shards")
    shutil.copy(job.workdir / "poison_task.py", copy.parent.parent)
    res = resume(copy, "--step", shrunk, "--nproc-per-node", 3, env=base_env(OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert same_weights(job.run_dir, copy)
