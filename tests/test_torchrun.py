"""``python -m ddp_slurm.launch``: torchrun that survives the stop signal and passes it on; the sbatch
scripts' checks that run without a cluster. (On the real cluster: tests/cluster/test_sbatch.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, base_env

from ddp_slurm.launch import torchrun as launch
from ddp_slurm.train import checkpoint, logs
from ddp_slurm.train import loop as train

SCRIPTS = [REPO / "sbatch" / "mnist_4node.sh", REPO / "sbatch" / "mnist_torchrun.sh"]
MLP = ["model.name=mlp", "train.epochs=40", "checkpoint.every_steps=20"]  # long enough to be interrupted


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_training(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["kind"] == "train" for r in rows(run_dir)):
        assert proc.poll() is None, f"exited {proc.returncode} before training:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "no training within the timeout"
        time.sleep(0.05)


def torchrun(launcher, module: str, *overrides: str) -> subprocess.Popen:
    return launcher.popen(
        [sys.executable, "-m", module, "--standalone", "--nproc_per_node", "2", "-m", "ddp_slurm.train", *overrides]
    )


def test_exit_code_matches_train():
    assert launch.EXIT_STOPPED == train.EXIT_STOPPED == 75


def test_usr2_to_the_agent_alone_reaches_the_workers(launcher, tmp_path):
    """The signal goes to the agent only (no Slurm here to signal the workers too): the launcher
    survives it, passes it on, the workers checkpoint and stop, and the launcher exits 75."""
    run_dir = tmp_path / "runs" / "usr2"
    proc = torchrun(launcher, "ddp_slurm.launch", *MLP, "run.name=usr2")
    wait_for_training(proc, run_dir)
    os.kill(proc.pid, signal.SIGUSR2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == train.EXIT_STOPPED, out
    assert "SIGUSR2 passed on to 2 worker process(es)" in out
    assert "all workers stopped on a signal after a checkpoint: exit 75" in out
    [stop] = [r for r in rows(run_dir) if r["kind"] == "stop"]
    assert stop["requeue"] is True and 0 < stop["step"] < 40 * (5000 // 64)
    state = checkpoint.load_latest(run_dir)
    assert state["step"] == stop["step"] and not state["finished"]


def test_ctrl_c_to_the_launcher_exits_75_and_the_run_resumes_with_its_own_config(launcher, tmp_path):
    """SIGINT (Ctrl-C) to the launcher: torchrun passes it on, the workers checkpoint and exit 75, and so
    does the launcher, in one line instead of torchrun's ChildFailedError traceback. Rank 0's stop line names
    the command that resumes; that command, typed as shown (no launcher), finishes the run with the overrides
    it was started with and at the world size it had (2 ranks, not 1 with a warning)."""
    run_dir = tmp_path / "runs" / "int"
    overrides = ["model.name=mlp", "train.epochs=2", "train.lr=2e-3", "checkpoint.every_steps=20", "run.name=int"]
    proc = torchrun(launcher, "ddp_slurm.launch", *overrides)
    wait_for_training(proc, run_dir)
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == train.EXIT_STOPPED, out
    assert "interrupted: every worker stopped after a checkpoint; exit 75" in out
    assert "Traceback" not in out and "ChildFailedError" not in out
    assert re.search(r"stopped on signal at step \d+ with a checkpoint; resume with: ddp-slurm resume runs/int", out)
    [stop] = [r for r in rows(run_dir) if r["kind"] == "stop"]
    res = launcher.run([sys.executable, "-m", "ddp_slurm", "resume", "runs/int"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "runs/int resumes with 2 local ranks" in res.stderr and "resuming at world size" not in res.stderr
    start = [r for r in rows(run_dir) if r["kind"] == "start"][-1]
    assert start["resumed"] and start["step"] == stop["step"] and start["world_size"] == 2
    assert rows(run_dir)[-1]["kind"] == "end"


def test_a_mashed_ctrl_c_still_exits_75_after_the_workers_checkpoint(launcher, tmp_path):
    """Ctrl-C pressed three times in a row (SIGINT to the terminal's whole process group, 5 ms apart) once
    exited 130, its line before the workers' checkpoint line: a wrapper that resumes on 75 would not resume.
    The launcher now waits for its workers' own exits, and says so after their stop line."""
    run_dir = tmp_path / "runs" / "mash"
    proc = torchrun(launcher, "ddp_slurm.launch", *MLP, "run.name=mash")
    wait_for_training(proc, run_dir)
    for _ in range(3):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.005)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == train.EXIT_STOPPED, out
    lines = out.splitlines()
    said = next(i for i, line in enumerate(lines) if "interrupted: every worker stopped after a checkpoint" in line)
    stopped = next(
        i for i, line in enumerate(lines) if re.search(r"stopped on signal at step \d+ with a checkpoint", line)
    )
    assert stopped < said, out
    [stop] = [r for r in rows(run_dir) if r["kind"] == "stop"]
    assert checkpoint.load_latest(run_dir)["step"] == stop["step"]


def test_a_worker_failure_ends_in_one_line_with_the_worker_s_exit_code(launcher):
    """A worker that fails (here a config error, exit 2): its own line, then one line from the launcher
    naming the rank and the file with torchrun's full report, no traceback; the exit status is the worker's."""
    proc = torchrun(launcher, "ddp_slurm.launch", "model.name=mlp", "train.epochz=3")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    last = out.splitlines()[-1]
    assert re.search(r"launch \[.*\]: worker rank \d \(local rank \d, pid \d+\) exited 2: .*; exit 2", last), last
    report = Path(re.search(r"full report: (\S+)\)$", last).group(1))
    try:
        assert "ChildFailedError" in report.read_text() and oct(report.stat().st_mode & 0o777) == "0o600"
    finally:
        report.unlink()


def test_plain_torchrun_agent_dies_of_usr2(launcher, tmp_path):
    """Why the launcher exists: torchrun's own agent is killed by the same signal."""
    proc = torchrun(launcher, "torch.distributed.run", *MLP, "run.name=plain")
    try:
        wait_for_training(proc, tmp_path / "runs" / "plain")
        os.kill(proc.pid, signal.SIGUSR2)
        # wait(), not communicate(): the orphaned workers keep the output pipe open
        assert proc.wait(timeout=300) == -signal.SIGUSR2
    finally:
        stop_orphans(tmp_path)


def stop_orphans(cwd: Path, timeout: float = 120) -> None:
    """Kill the workers a dead agent left behind (found by their working directory, which is this
    test's own) and wait until they are gone. SIGKILL: without their agent's store they would only
    linger in their shutdown."""

    def running() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.readlink(entry / "cwd") == str(cwd):
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    deadline = time.monotonic() + timeout
    while pids := running():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert time.monotonic() < deadline, f"workers {pids} still running"
        time.sleep(0.5)


def test_child_pids_lists_direct_children():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in launch.child_pids(os.getpid())
        assert os.getpid() not in launch.child_pids(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_rank_map_groups_ranks_by_host():
    assert logs.rank_map(["n1", "n2", "n3", "n4"]) == "n1: 0; n2: 1; n3: 2; n4: 3"
    assert logs.rank_map(["a", "a", "b", "b", "a"]) == "a: 0-1,4; b: 2-3"
    assert logs.rank_map(["solo"]) == "solo: 0"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_valid_bash_with_the_slurm_options(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for option in (
        "--nodes=4",
        "--ntasks-per-node=",
        "--gpus-per-node=4",
        "--cpus-per-task=",
        "--time=",
        "--signal=USR2@",
        "--requeue",
        "--open-mode=append",
        "--output=%x-%j.out",
    ):
        assert f"#SBATCH {option}" in text, option
    assert '"$@"' in text
    # Their supervisor runs srun --kill-on-bad-exit=1 and relaunches after a loss (tests/test_restarts.py).
    assert "#SBATCH --no-kill" in text and '"$PYTHON" -m ddp_slurm.launch.supervise ' in text


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_says_which_python_is_missing(script, tmp_path):
    env = base_env(DDP_SLURM_PYTHON=str(tmp_path / "no-such-python"), SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="7")
    res = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "no-such-python" in res.stderr and "DDP_SLURM_PYTHON" in res.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_says_when_python_lacks_the_package(script, tmp_path):
    """A Python without the package (here: with -I, which ignores PYTHONPATH and the working directory
    can't help either, from a directory outside the project) is refused before srun runs."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    fake.chmod(0o755)
    env = base_env(DDP_SLURM_PYTHON=str(fake), SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="7")
    res = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "cannot import ddp_slurm" in res.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_outside_slurm_says_to_use_sbatch(script, tmp_path):
    res = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "submit it with `sbatch" in res.stderr, res.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_runs_a_task_with_its_own_defaults_as_docs_tasks_says(script, tmp_path):
    """docs/tasks.md and the scripts agree on which config a job reads: ``--config FILE``; else, with
    ``task=...`` among the arguments, the task's own defaults (no YAML of its own needed); else jobs/mnist.yaml.
    (srun here is a stand-in that prints what it would start.)"""
    page = " ".join((REPO / "docs" / "tasks.md").read_text().split())
    assert "else `task=...` among the arguments, that task's own defaults (no YAML needed" in page
    assert "give your task its own YAML file" not in page
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\necho "srun $*"\n')
    (bin_dir / "srun").chmod(0o755)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")  # the torchrun script's head node
    (bin_dir / "scontrol").chmod(0o755)
    env = base_env(SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="node1")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["DDP_SLURM_PYTHON"] = sys.executable

    def started(*args: str) -> str:
        res = subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
        [line] = [x for x in res.stdout.splitlines() if x.startswith("srun ")]
        return line

    assert "--config" not in started("task=my_project.tasks:Digits", "train.epochs=5")
    assert f"--config {REPO / 'jobs' / 'mnist.yaml'}" in started()
    assert "--config mine.yaml" in started("--config", "mine.yaml", "train.epochs=5")


def test_no_omp_banner_opens_a_launch(launcher, tmp_path):
    """torchrun's five-line OMP_NUM_THREADS banner opened every launch: the launcher makes its choice (one
    thread per worker of several) itself, quietly, and a value the user set is kept."""
    env = base_env()
    env.pop("OMP_NUM_THREADS")
    cmd = [sys.executable, "-m", "ddp_slurm.launch", "--standalone", "--nproc_per_node", "2", "-m", "ddp_slurm.train"]
    res = launcher.run([*cmd, "model.name=mlp", "train.max_steps=2", "run.name=omp"], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OMP_NUM_THREADS" not in res.stdout + res.stderr
