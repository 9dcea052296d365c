"""How many training processes sbatch/mnist_torchrun.sh starts per node, and what both sbatch scripts
export for NCCL: the pure rule (launch/nproc.py) and the scripts themselves.

The script-level tests run the real scripts with a fabricated Slurm environment (the interesting cases,
a GPU job whose Slurm sets no SLURM_GPUS_ON_NODE, cannot be produced on the test cluster, whose GPUs are
fake) and with stand-ins for ``srun`` and ``scontrol`` on PATH that record what they were given instead
of starting a job step: everything before the step is the script's own, unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, base_env

from ddp_slurm.launch import nproc

TORCHRUN = REPO / "sbatch" / "mnist_torchrun.sh"
SRUN = REPO / "sbatch" / "mnist_4node.sh"


@pytest.mark.parametrize(
    ("environ", "count", "source"),
    [
        ({"DDP_SLURM_NPROC_PER_NODE": "3", "SLURM_GPUS_ON_NODE": "8"}, 3, "DDP_SLURM_NPROC_PER_NODE"),
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "2"}, 4, "one per GPU: SLURM_GPUS_ON_NODE=4"),
        ({"SLURM_GPUS_PER_NODE": "4"}, 4, "one per GPU: SLURM_GPUS_PER_NODE=4"),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, 4, "one per GPU: SLURM_GPUS_PER_NODE=a100:4"),
        ({"SLURM_GPUS_PER_NODE": "gpu:a100:2,v100:2"}, 4, "one per GPU: SLURM_GPUS_PER_NODE=gpu:a100:2,v100:2"),
        ({"SLURM_JOB_GPUS": "0,1,2", "SLURM_GPUS": "3"}, 3, "one per GPU: SLURM_JOB_GPUS=0,1,2"),
        (
            {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_TRES_PER_NODE": "gres/gpu:2"},
            2,
            "one per GPU: CUDA_VISIBLE_DEVICES=0,1",
        ),
        ({}, 1, "no GPUs in this job: one CPU process per node (DDP_SLURM_NPROC_PER_NODE=N for more)"),
        (
            {"SLURM_TRES_PER_TASK": "cpu:2"},
            1,
            "no GPUs in this job: one CPU process per node (DDP_SLURM_NPROC_PER_NODE=N for more)",
        ),
    ],
)
def test_processes_per_node_follow_the_gpus(environ: dict[str, str], count: int, source: str) -> None:
    assert nproc.procs_per_node(environ) == (count, source)


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"SLURM_GPUS": "8"}, "SLURM_GPUS=8"),
        ({"SLURM_GPUS_PER_TASK": "1"}, "SLURM_GPUS_PER_TASK=1"),
        ({"SLURM_TRES_PER_TASK": "cpu:4,gres/gpu:1"}, "SLURM_TRES_PER_TASK=cpu:4,gres/gpu:1"),
        ({"SLURM_GPUS_ON_NODE": "0", "SLURM_GPUS": "2"}, "SLURM_GPUS=2"),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles", "SLURM_GPUS": "2"}, "SLURM_GPUS=2"),
    ],
)
def test_a_gpu_job_without_a_per_node_count_is_refused(environ: dict[str, str], named: str) -> None:
    with pytest.raises(nproc.NprocError) as info:
        nproc.procs_per_node(environ)
    message = str(info.value)
    assert named in message and "--gpus-per-node=N" in message and "DDP_SLURM_NPROC_PER_NODE=N" in message, message


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_nproc_setting_is_refused(value: str) -> None:
    with pytest.raises(nproc.NprocError, match=f"DDP_SLURM_NPROC_PER_NODE='{value}' is not a positive integer"):
        nproc.procs_per_node({"DDP_SLURM_NPROC_PER_NODE": value, "SLURM_GPUS_ON_NODE": "4"})


# ------------------------------------------------------------------------- the scripts themselves
RECORDER = """#!{python}
import json, os, sys
with open({out!r}, "a") as f:
    f.write(json.dumps({{"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
if os.path.basename(sys.argv[0]) == "scontrol":
    print("node1")
"""


def run_script(script: Path, tmp_path: Path, **slurm: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``script`` as sbatch would (in the submit directory, with the job's variables); srun and
    scontrol record their arguments and environment."""
    bin_dir, out = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol"):
        path = bin_dir / tool
        path.write_text(RECORDER.format(python=sys.executable, out=str(out)))
        path.chmod(0o755)
    env = base_env(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
        PYTHONPATH=str(REPO),
        SLURM_JOB_ID="4242",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_CPUS_PER_TASK="8",
        **slurm,
    )
    env.pop("OMP_NUM_THREADS", None)
    res = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    calls = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return res, calls


@pytest.mark.parametrize(
    ("slurm", "expected"),
    [({"SLURM_GPUS_ON_NODE": "4"}, "4"), ({"SLURM_GPUS_PER_NODE": "h100:2"}, "2"), ({}, "1")],
)
def test_torchrun_script_starts_one_process_per_gpu(tmp_path: Path, slurm: dict[str, str], expected: str) -> None:
    res, calls = run_script(TORCHRUN, tmp_path, **slurm)
    assert res.returncode == 0, res.stderr
    [srun] = [c for c in calls if c["tool"] == "srun"]
    assert f"--nproc-per-node={expected}" in srun["argv"], srun["argv"]
    assert srun["env"]["OMP_NUM_THREADS"] == str(8 // int(expected))
    assert f"{expected} process(es) per node (" in res.stdout, res.stdout


def test_torchrun_script_refuses_gpus_it_cannot_count(tmp_path: Path) -> None:
    """--gpus=8 over 2 nodes: Slurm sets no per-node count; the job stops before srun with the fix."""
    res, calls = run_script(TORCHRUN, tmp_path, SLURM_GPUS="8")
    assert res.returncode == 2, res.stdout + res.stderr
    assert [c for c in calls if c["tool"] == "srun"] == []
    assert "error: the job asked for GPUs (SLURM_GPUS=8)" in res.stderr and "--gpus-per-node=N" in res.stderr


@pytest.mark.parametrize("script", [TORCHRUN, SRUN], ids=lambda p: p.name)
def test_scripts_leave_nccl_evidence_of_a_hang(tmp_path: Path, script: Path) -> None:
    """The job step gets NCCL's flight recorder and its dump on timeout, into a directory that exists."""
    res, calls = run_script(script, tmp_path, SLURM_GPUS_ON_NODE="4", SLURM_RESTART_COUNT="2")
    assert res.returncode == 0, res.stderr
    [srun] = [c for c in calls if c["tool"] == "srun"]
    env = srun["env"]
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/nccl-traces/4242.2-rank"
    assert (tmp_path / "nccl-traces").is_dir()
    assert "NCCL_SOCKET_IFNAME" not in env
