"""What sbatch/mnist_torchrun.sh reads to start one process per GPU, asked of real Slurm: the same
``python -m ddp_slurm.launch.nproc`` the script runs, in batch jobs with the test cluster's (fake) GPUs."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("request_args", "expected"),
    [
        (["-N2", "--gpus-per-node=2"], "2 one per GPU: SLURM_GPUS_ON_NODE=2"),
        (["-N1", "--gpus=2"], "2 one per GPU: SLURM_GPUS_ON_NODE=2"),
        (["-N1", "--gpus-per-node=1"], "1 one per GPU: SLURM_GPUS_ON_NODE=1"),
        (["-N1"], "1 no GPUs in this job: one CPU process per node (DDP_SLURM_NPROC_PER_NODE=N for more)"),
    ],
)
def test_processes_per_node_in_real_batch_jobs(slurm_cluster, tmp_path: Path, request_args: list[str], expected: str):
    out = tmp_path / "nproc.out"
    command = f"PYTHONPATH={shlex.quote(str(REPO))} {shlex.quote(sys.executable)} -m ddp_slurm.launch.nproc"
    job = slurm_cluster.sbatch([*request_args, "-o", str(out), "--wrap", command], cwd=tmp_path)
    assert slurm_cluster.wait(job, timeout=120) == "COMPLETED", (slurm_cluster.job_info(job), out.read_text())
    assert out.read_text().strip() == expected
