"""``python -m ddp_slurm.submit`` on the real 4-node test cluster: a 4-node run to the end, a USR2
mid-run that requeues the job once and resumes it to bit-identical weights, and a 3-run job array.

The uninterrupted 4-node run is the reference of the interrupted one (same config, other run name),
so the cluster runs it only once.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddp_slurm.train.checkpoint import load_latest

pytestmark = pytest.mark.cluster

RESOURCES = ["--nodes", "4", "--tasks-per-node", "1", "--cpus-per-task", "2"]
TINY = ["model.name=mlp", "train.max_steps=100", "train.log_every_steps=10", "checkpoint.every_steps=50"]


@dataclass
class Submitted:
    res: subprocess.CompletedProcess
    cwd: Path
    job_id: str
    run_dir: Path


def submit_env(cluster) -> dict[str, str]:
    return {**cluster.env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def parse(res: subprocess.CompletedProcess, cwd: Path) -> Submitted:
    """The job id and the run (or sweep) directory that the submit command printed."""
    job = re.search(r"^job: (\S+) ", res.stdout, re.M)
    run = re.search(r"^(?:run|sweep) directory: (.+)$", res.stdout, re.M)
    return Submitted(res, cwd, job[1] if job else "", Path(run[1]) if run else cwd)


def submit(cluster, cwd: Path, *args: str, timeout: float = 900, **env: str) -> Submitted:
    """Run the submit command against the cluster (``env``: extra variables for it)."""
    res = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.submit", *args],
        cwd=cwd,
        env={**submit_env(cluster), **env},
        text=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
    )
    return parse(res, cwd)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rank_hosts(log_dir: Path, job_id: str) -> dict[int, str]:
    """Which node each rank ran on, from submitit's first line in each rank's log."""
    hosts = {}
    for log in log_dir.glob(f"{job_id}_*_log.out"):
        m = re.search(r"hostname=(\S+), local_rank=\d+\(\d+\), node=\d+\(\d+\), global_rank=(\d+)", log.read_text())
        if m:
            hosts[int(m[2])] = m[1]
    return hosts


@pytest.fixture(scope="module")
def four_nodes(slurm_cluster, tmp_path_factory) -> tuple[Submitted, str]:
    """The reference: ``--nodes 4 --wait`` to the end, and the ``--dry-run`` of the same command."""
    cwd = tmp_path_factory.mktemp("submit-4n")
    args = [*RESOURCES, "--name", "ref", *TINY]
    dry = submit(slurm_cluster, cwd, "--dry-run", *args)
    assert dry.res.returncode == 0, dry.res.stderr
    return submit(slurm_cluster, cwd, "--wait", *args), dry.res.stdout


def test_four_nodes_run_to_the_end(slurm_cluster, four_nodes) -> None:
    done, dry_script = four_nodes
    assert done.res.returncode == 0, done.res.stdout[-3000:] + done.res.stderr
    assert re.search(r"^finished: 100 steps, final test accuracy \d+\.\d\d%", done.res.stdout, re.M), done.res.stdout
    log_dir = done.run_dir / "submitit" / done.job_id
    # The job ran its 4 ranks on 4 different nodes, as an srun step (launcher "slurm").
    hosts = rank_hosts(log_dir, done.job_id)
    assert sorted(hosts) == [0, 1, 2, 3] and sorted(hosts.values()) == slurm_cluster.nodes, hosts
    start = rows(done.run_dir)[0]
    assert (start["world_size"], start["launcher"], start["resumed"]) == (4, "slurm", False)
    assert rows(done.run_dir)[-1]["kind"] == "end"
    info = slurm_cluster.job_info(done.job_id)
    assert info["NumNodes"] == "4" and info["JobState"] == "COMPLETED" and info["Restarts"] == "0"
    # --dry-run printed exactly the script that was submitted.
    assert (log_dir / f"{done.job_id}_submission.sh").read_text() == dry_script
    assert "#SBATCH --signal=USR2@120\n" in dry_script and "#SBATCH --requeue\n" in dry_script


@contextlib.contextmanager
def following(cluster, cwd: Path, *args: str) -> Iterator[tuple[subprocess.Popen, Path, Submitted]]:
    """``submit --wait ARGS`` in the background; yields it once the job runs and has trained 20 steps."""
    out = cwd / f"wait-{time.monotonic_ns()}.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddp_slurm.submit", "--wait", *args],
            cwd=cwd,
            env=submit_env(cluster),
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while not re.search(r"^run directory: ", out.read_text(), re.M):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        sub = parse(subprocess.CompletedProcess([], 0, out.read_text(), ""), cwd)
        # The job may wait for nodes that other tests' jobs hold.
        cluster.wait_state(sub.job_id, "RUNNING", timeout=600)
        deadline = time.monotonic() + 240
        while not (
            (sub.run_dir / "metrics.jsonl").exists()
            and any(r["kind"] == "train" and r["step"] >= 20 for r in rows(sub.run_dir))
        ):
            assert time.monotonic() < deadline, f"training did not reach step 20: {cluster.job_info(sub.job_id)}"
            time.sleep(0.2)
        yield proc, out, sub
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_usr2_mid_run_requeues_once_and_resumes_bit_identical(slurm_cluster, four_nodes) -> None:
    reference, _ = four_nodes
    assert reference.res.returncode == 0, reference.res.stderr
    # Followed with --wait: following the job must survive its requeue.
    with following(slurm_cluster, reference.cwd, *RESOURCES, "--name", "sig", *TINY) as (follower, out, sub):
        slurm_cluster.cancel(sub.job_id, "--signal=USR2")  # every task of the step, as Slurm's --signal does
        slurm_cluster.release(sub.job_id, timeout=120)  # requeued: start it now instead of after BeginTime
        assert follower.wait(timeout=300) == 0, out.read_text()[-3000:]
    assert slurm_cluster.state(sub.job_id) == "COMPLETED", slurm_cluster.job_info(sub.job_id)
    assert slurm_cluster.job_info(sub.job_id)["Restarts"] == "1"  # requeued once, not twice
    followed = out.read_text()  # rank 0's log through both runs of the job, then the result
    assert followed.count("starting run") == 1 and followed.count("resuming run") == 1, followed[-3000:]
    assert re.search(r"^finished: 100 steps, final test accuracy \d+\.\d\d%", followed, re.M), followed[-3000:]

    kinds = rows(sub.run_dir)
    stops = [r for r in kinds if r["kind"] == "stop"]
    starts = [r for r in kinds if r["kind"] == "start"]
    assert len(stops) == 1 and stops[0]["requeue"] and 20 <= stops[0]["step"] < 100, stops
    assert [(s["resumed"], s["restart_count"], s["step"]) for s in starts] == [
        (False, 0, 0),
        (True, 1, stops[0]["step"]),
    ]
    assert kinds[-1]["kind"] == "end" and kinds[-1]["step"] == 100
    log0 = (sub.run_dir / "submitit" / sub.job_id / f"{sub.job_id}_0_log.out").read_text()
    assert log0.count(f"requeued Slurm job {sub.job_id}") == 1  # training's requeue, once
    assert "Requeued job" not in log0 and "checkpoint_and_try_requeue" not in log0  # submitit's never ran

    ours, ref = load_latest(sub.run_dir), load_latest(reference.run_dir)
    assert ours["step"] == ref["step"] == 100 and ours["finished"]
    assert ours["model"].keys() == ref["model"].keys()
    different = [k for k in ref["model"] if not torch.equal(ours["model"][k], ref["model"][k])]
    assert not different, f"weights differ from the uninterrupted run in {different}"


def test_requeue_cap_ends_the_job_with_exit_3(slurm_cluster, tmp_path) -> None:
    # One rank on one node, long enough (in steps) to be stopped mid-run; no requeue is allowed.
    args = [
        "--nodes",
        "1",
        "--cpus-per-task",
        "2",
        "--name",
        "capped",
        "model.name=mlp",
        "train.epochs=30",
        "train.log_every_steps=10",
        "slurm.max_requeues=0",
    ]
    with following(slurm_cluster, tmp_path, *args) as (follower, out, sub):
        slurm_cluster.cancel(sub.job_id, "--signal=USR2")
        code = follower.wait(timeout=300)
    text = out.read_text()
    assert code == 3, text[-3000:]
    assert "rank 0 failed: training exited 3 on rank 0 (requeue cap reached (slurm.max_requeues)): " in text, text[
        -2000:
    ]
    info = slurm_cluster.job_info(sub.job_id)
    assert info["Restarts"] == "0" and info["JobState"] == "FAILED", info
    assert [r["kind"] for r in rows(sub.run_dir)][-1] == "stop"  # the checkpoint is there to resume by hand
    assert load_latest(sub.run_dir)["step"] == rows(sub.run_dir)[-1]["step"]


def test_sweep_of_three_is_a_job_array_with_three_run_directories(slurm_cluster, tmp_path) -> None:
    values = ["1e-3", "3e-3", "1e-2"]
    # Leftovers of a torchrun session in the submitting shell (sbatch exports it) must not reach the tasks.
    leftovers = {"RANK": "3", "WORLD_SIZE": "7", "MASTER_ADDR": "localhost"}
    sub = submit(
        slurm_cluster,
        tmp_path,
        "--nodes",
        "1",
        "--cpus-per-task",
        "2",
        "--name",
        "lrs",
        "--wait",
        "--sweep",
        "train.lr=" + ",".join(values),
        "model.name=mlp",
        "train.max_steps=20",
        "train.epochs=1",
        **leftovers,
    )
    assert sub.res.returncode == 0, sub.res.stdout + sub.res.stderr
    root = tmp_path / "runs" / "lrs"
    assert sub.run_dir == root
    script = next((root / "submitit").glob("*/*_submission.sh")).read_text()
    assert "#SBATCH --array=0-2%3\n" in script
    for task, value in enumerate(values):
        run = root / f"lr={value}"
        assert rows(run)[-1]["kind"] == "end" and rows(run)[-1]["step"] == 20
        assert f"lr: {float(value)}" in (run / "config.yaml").read_text()
        assert f"run {sub.job_id}_{task} (lr={value}): finished: 20 steps" in sub.res.stdout
    table = [line.split() for line in sub.res.stdout.splitlines() if line.startswith("lr=")]
    # ranked best first by the task's metric (test accuracy, higher is better), whatever the manifest order
    assert sorted(t[:4] for t in table) == sorted([f"lr={v}", v, "finished", "20"] for v in values)
    assert all(re.fullmatch(r"\d+\.\d\d%", t[4]) for t in table), table
    bests = [float(t[5].rstrip("%")) for t in table]
    assert bests == sorted(bests, reverse=True), table


def test_a_submission_slurm_rejects_is_one_line_and_leaves_nothing(slurm_cluster, tmp_path) -> None:
    sub = submit(slurm_cluster, tmp_path, "--partition", "no-such-partition", "--name", "rejected", "model.name=mlp")
    assert sub.res.returncode == 2, sub.res.stdout + sub.res.stderr
    lines = sub.res.stderr.strip().splitlines()  # the misfit warnings said before it queues, then one error
    *warnings, error = lines
    assert error.startswith("python -m ddp_slurm.submit: error: sbatch failed: "), lines
    assert all(w.startswith("python -m ddp_slurm.submit: warning: ") for w in warnings), lines
    assert "partition" in error.lower()
    assert not (tmp_path / "runs").exists()


def test_a_job_asking_for_no_gpu_on_gpu_nodes_is_warned_with_the_count(slurm_cluster, tmp_path) -> None:
    """The test cluster's nodes have gpu:2 GRES: `--nodes 1` alone (a CPU job) is warned, naming the number
    to add, from the partition's own GRES; asking for the GPUs is not warned. Nothing is submitted."""
    cpu = submit(slurm_cluster, tmp_path, "--dry-run", "--nodes", "1", "--name", "cpu")
    assert cpu.res.returncode == 0, cpu.res.stderr
    want = f"gpu:{slurm_cluster.gpus_per_node}"
    assert f"have GPUs (sinfo: {want}" in cpu.res.stderr, cpu.res.stderr
    assert f"add --gpus-per-node {slurm_cluster.gpus_per_node} to train on them" in cpu.res.stderr
    named = submit(slurm_cluster, tmp_path, "--dry-run", "--partition", slurm_cluster.partition, "--name", "p")
    assert f"the nodes of partition {slurm_cluster.partition} have GPUs" in named.res.stderr, named.res.stderr
    gpu = submit(slurm_cluster, tmp_path, "--dry-run", "--nodes", "1", "--gpus-per-node", "2", "--name", "gpu")
    assert gpu.res.returncode == 0 and "have GPUs" not in gpu.res.stderr, gpu.res.stderr
    assert not (tmp_path / "runs").exists()
