"""Restarting inside the allocation on the real 4-node test cluster (issue 33): the project's sbatch scripts and submit jobs
keeps its allocation when a node fails (``--no-kill``) and its supervisor (ddp_slurm/launch/supervise.py)
relaunches the training step on the nodes left, from the newest checkpoint: the same job, Restarts=0.

``down``   4 nodes x 1 rank, global batch 48: node3 is set DOWN mid-run. Slurm ends the step ("Node failure")
           and drops node3 from the job; the step runs again on the 3 nodes left and trains to the end. Its
           weights equal those of the same run resumed by hand at world size 3 from that checkpoint
           (``ddp-slurm resume --step S --nproc-per-node 3`` on this machine): bit-identical.
``spare``  4 nodes, ``slurm.spare_nodes=1``: 3 train; rank 1 is SIGKILLed; the relaunch trains on 3 again,
           the spare in the lost node's place.
``capped`` 3 nodes, ``slurm.restarts=1``, requeue on: rank 1 killed, relaunched inside on 2 nodes; rank 1
           killed again: past the cap the survivor requeues the job without both nodes (Restarts=1).

``drained`` ``sbatch --nodes=3-4`` while node2 is drained: the job starts on 3 nodes, world size 3, and with
           ``train.micro_batch_size=4`` chooses 4 micro-batches per step (3 on 4 nodes); the sample ids of every
           optimizer step equal those of a 4-rank reference run (torchrun on this machine), micro-batches of 4.
           (Slurm 22.05 starts a range on its MIN when MIN nodes are free, even with more idle: ``--nodes=2-4``
           would start on 2 here.)

``silent`` 4 nodes x 1 rank, the poison task recording its batches, dist.timeout_s left at 300 s: failures shaped
           like NCCL's, which no socket reports. Rank 1 is frozen (SIGSTOP): the survivors' stall check names it,
           records its node in lost_nodes before it exits, writes its flight-recorder file, and the supervisor
           relaunches on 3 nodes. Then the relaunch's rank 1 node is powered off (link cut, then everything in it
           killed: no FIN, no RST; nobody sets it DOWN): named and recorded the same way, and the supervisor ends the
           step that srun would keep waiting for until Slurm's node timeout, and relaunches on 2 nodes. Restarts=0;
           the global batches equal those of the run left alone (``reference``); each launch a fresh MASTER_PORT
           and its own trace files.

``headless`` 2 nodes, requeue on: node1, which runs the batch script, its supervisor and rank 0 (the rendezvous
           store's host), is powered off. Every store operation hangs, so no heartbeat can judge; the survivor's
           sentinel sees its store operation wait, names rank 0's host, records it and, the supervisor being gone
           with it, requeues the job without node1 itself (else Slurm leaves a zombie job: its batch host dead).

``torchrun`` sbatch/mnist_torchrun.sh on 3 nodes (one agent each, one rank per agent): node3 set DOWN mid-run;
           the agents are launched again on node1 and node2 with a fresh rendezvous, world size 2, to the end.

``submitted`` the same through ``python -m ddp_slurm.submit --nodes 3``: its script defines ``srun`` as the
           supervisor, so submitit's pickled job is launched again on node1 and node2.

``slowed``  3 nodes x 1 rank, the cnn: once training runs, rank 1's process is moved into a cgroup with 5% of one CPU
           (cgroup v1 ``cpu.cfs_quota_us``); within ``slurm.slow_windows=3`` log windows (``slow_factor=5``) it is
           named with its host: a warning, a ``slow`` line, ``slow_nodes``. The ``drained`` run beside it (quiet) names nobody.

``down``, ``drained``, ``silent``, ``headless``, ``torchrun`` and ``submitted`` run first, one at a time (a DOWN node ends every job's step on
it); then ``spare``, ``capped`` and ``slowed`` together.
Every rank has one CPU, so runs are bit-for-bit repeatable.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cluster.test_faults_cluster import (
    EVERY,
    REPO,
    SAMPLE,
    Driver,
    Job,
    assert_nothing_left,
    environ_of,
    kill_mid_training,
    training_rank,
)
from conftest import Launcher, base_env
from guard_helpers import global_batches, same_weights, write_poison_task
from helpers import resume

from ddp_slurm.bootstrap import expand_hostlist
from ddp_slurm.distributed import stall
from ddp_slurm.slurmjob import badnodes
from ddp_slurm.train import checkpoint

pytestmark = pytest.mark.cluster

TRAIN = [
    "model.name=mlp",
    "train.global_batch_size=48",  # splits over 4, 3 and 2 ranks
    "train.log_every_steps=1",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep=100",
]
ONE_PER_NODE = ["--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1"]


def submit(d: Driver, job: Job, nodes: int, *train: str, sbatch: tuple[str, ...] = ()) -> Job:
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={job.name}", *TRAIN, *train]
    script = str(REPO / "sbatch" / "mnist_4node.sh")
    return d.submit(job, [f"--nodes={nodes}", *ONE_PER_NODE, *sbatch, script, "--config", SAMPLE, *args])


def down_mid_run(d: Driver, job: Job, node: str = "node3") -> dict[str, Any]:
    """Set ``node`` DOWN after the job's second checkpoint, wait for the relaunch, put it back, wait for the end.
    The jobs run 3 epochs (about 300 steps): on an idle machine one epoch of the MLP ended within the second or
    two between its second checkpoint and the DOWN, and the job completed before any relaunch."""
    d.wait_for(job, "two checkpoints", lambda: len(list((job.run_dir / "checkpoints").glob("step-*.pt"))) >= 2)
    lost = time.monotonic()
    d.cluster.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=test"], timeout=30)
    try:
        d.wait_for(job, "the relaunch", lambda: len(job.rows("start")) == 2)
        d.wait_for(job, "training again", lambda: job.rows()[-1]["kind"] == "train")
        again = time.monotonic() - lost
        during = d.cluster.job_info(job.job_id)
    finally:
        d.cluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=30)
    d.finish(job)
    return {"job": job, "again": again, "during": during}


def run_down(d: Driver) -> dict[str, Any]:
    return down_mid_run(d, submit(d, Job("down", d.workdir), 4, "train.epochs=3", "dist.timeout_s=30"))


RANGED = [
    "task=poison_task.py:Poison",  # a task that records the sample ids of each micro-batch
    "poison.record=true",
    "train.epochs=1",
    "train.global_batch_size=48",
    "train.micro_batch_size=4",  # 4 ranks: 3 micro-batches per step; 3 ranks: 4; 2 ranks: 6
    "train.log_every_steps=1",
    "poison.size=4800",  # 100 steps: room for two faults and two relaunches (silent)
]


def run_drained(d: Driver) -> dict[str, Any]:
    write_poison_task(d.workdir)
    job = Job("drained", d.workdir)
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={job.name}", *RANGED]
    d.cluster.wait_idle()  # a node still finishing the last job would make Slurm start this one on 2
    d.cluster.run(["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=test"], timeout=30)
    try:
        d.submit(job, ["--nodes=3-4", *ONE_PER_NODE, str(REPO / "sbatch" / "mnist_4node.sh"), *args])
        d.wait_for(job, "its start", lambda: job.rows("start"))
        during = d.cluster.job_info(job.job_id)
    finally:
        d.cluster.run(["scontrol", "update", "NodeName=node2", "State=RESUME"], timeout=30)
    d.finish(job)
    return {"job": job, "during": during}


def relaunched(d: Driver, job: Job, starts: int, fault: float) -> float:
    """Seconds from ``fault`` (monotonic) until the ``starts``-th launch trains."""
    d.wait_for(job, f"launch {starts}", lambda: len(job.rows("start")) == starts)
    d.wait_for(job, "training again", lambda: job.rows()[-1]["kind"] == "train")
    return time.monotonic() - fault


def run_silent(d: Driver) -> dict[str, Any]:
    write_poison_task(d.workdir)
    job = Job("silent", d.workdir)
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={job.name}", *RANGED, "poison.sleep=0.01"]
    args += [f"checkpoint.every_steps={EVERY}", "checkpoint.keep=100"]  # dist.timeout_s: the default, 300 s
    d.submit(job, ["--nodes=4", *ONE_PER_NODE, str(REPO / "sbatch" / "mnist_4node.sh"), *args])
    out: dict[str, Any] = {"job": job}
    vanished = ""
    try:
        d.wait_for(job, "two checkpoints", lambda: len(checkpoint.list_checkpoints(job.run_dir)) >= 2)
        pid = d.wait_for(job, "rank 1's process", lambda: training_rank(job.job_id, 1))
        out["frozen"] = environ_of(pid).get("SLURMD_NODENAME", "?")
        os.kill(pid, signal.SIGSTOP)  # a hung GPU's rank, or a frozen node: no heartbeat, no error, no exit
        out["frozen_again"] = relaunched(d, job, 2, time.monotonic())
        had = len(checkpoint.list_checkpoints(job.run_dir))
        d.wait_for(job, "two more checkpoints", lambda: len(checkpoint.list_checkpoints(job.run_dir)) >= had + 2)
        pid = d.wait_for(job, "the relaunch's rank 1", lambda: training_rank(job.job_id, 1))
        vanished = out["vanished"] = environ_of(pid).get("SLURMD_NODENAME", "?")
        d.cluster.power_off(vanished)
        out["vanished_again"] = relaunched(d, job, 3, time.monotonic())
        out["during"] = d.cluster.job_info(job.job_id)
        d.wait_for(job, "the end of training", lambda: job.rows()[-1]["kind"] == "end")
        # what an admin would do: Slurm gives the node up now, not after its node timeout (the job completes)
        d.cluster.run(["scontrol", "update", f"NodeName={vanished}", "State=DOWN", "Reason=test"], timeout=30)
        d.finish(job)
    finally:
        if vanished:
            d.cluster.power_on(vanished)
    return out


def run_headless(d: Driver) -> dict[str, Any]:
    job = submit(d, Job("headless", d.workdir), 2, "train.epochs=100", sbatch=("--nodelist=node1,node2",))
    d.wait_for(job, "two checkpoints", lambda: len(checkpoint.list_checkpoints(job.run_dir)) >= 2)
    d.cluster.power_off("node1")
    lost = time.monotonic()
    try:

        def requeued() -> dict[str, str] | None:
            info = d.cluster.job_info(job.job_id)
            return info if info["Restarts"] == "1" and info.get("ExcNodeList") == "node1" else None

        out = {"job": job, "requeued": d.wait_for(job, "the requeue without node1", requeued)}
        out["again"] = time.monotonic() - lost  # to the requeue: the job runs again once Slurm starts it
    finally:  # an admin's part: Slurm gives the node up now, not after its node timeout, and the job can end
        d.cluster.run(["scontrol", "update", "NodeName=node1", "State=DOWN", "Reason=test"], timeout=30)
        d.cluster.cancel(job.job_id)
        try:
            d.finish(job)
        finally:
            d.cluster.power_on("node1")
    return out


def run_torchrun(d: Driver) -> dict[str, Any]:
    job = Job("torchrun", d.workdir)
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={job.name}", *TRAIN, "train.epochs=3"]
    script = str(REPO / "sbatch" / "mnist_torchrun.sh")
    d.submit(
        job, ["--nodes=3", "--exclude=node4", *ONE_PER_NODE, script, "--config", SAMPLE, *args, "dist.timeout_s=30"]
    )
    return down_mid_run(d, job)


class SubmitJob(Job):
    @property
    def log(self):  # the batch script's and rank 0's log: one file (submitit)
        return self.run_dir / "submitit" / self.job_id / f"{self.job_id}_0_log.out"


def run_submitted(d: Driver) -> dict[str, Any]:
    job = SubmitJob("submitted", d.workdir)
    res = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.submit", "--nodes", "3", "--tasks-per-node", "1", "--cpus-per-task", "1"]
        + ["--sbatch", "exclude=node4", "--config", SAMPLE, f"run.output_root={d.workdir / 'runs'}"]
        + [f"run.name={job.name}", *TRAIN, "train.epochs=3", "dist.timeout_s=30"],
        cwd=d.workdir,
        env={**d.cluster.env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = re.search(r"^job: (\S+) ", res.stdout, re.M)
    assert res.returncode == 0 and found, res.stdout + res.stderr
    job.job_id = found[1]
    d.jobs.append(job)
    return down_mid_run(d, job)


def run_spare(d: Driver) -> dict[str, Any]:
    spare = ("train.epochs=100", "slurm.spare_nodes=1", "dist.timeout_s=30", "slurm.requeue=false")
    job = submit(d, Job("spare", d.workdir), 4, *spare)
    pid, node, _, killed = kill_mid_training(d, job, rank=1)
    d.wait_for(job, "the relaunch", lambda: len(job.rows("start")) == 2)
    d.wait_for(job, "training again", lambda: job.rows()[-1]["kind"] == "train")
    again = time.monotonic() - killed
    during = d.cluster.job_info(job.job_id)
    d.cluster.cancel(job.job_id, "--signal=USR2")
    d.finish(job)
    return {"job": job, "node": node, "again": again, "during": during}


def run_slowed(d: Driver) -> dict[str, Any]:
    # 5% of a CPU is a 20x slowdown; a factor of 5 names it and not the 2-3x jitter of three jobs on two cores.
    slowed = (
        "model.name=cnn",
        "train.epochs=100",
        "slurm.slow_windows=3",
        "slurm.slow_factor=5",
        "slurm.requeue=false",
    )
    job = submit(d, Job("slowed", d.workdir), 3, *slowed)  # cnn: enough compute per step for the quota to bite
    d.wait_for(job, "training", lambda: job.rows("train"))
    pid = d.wait_for(job, "rank 1's process", lambda: training_rank(job.job_id, 1))
    node = environ_of(pid).get("SLURMD_NODENAME", "?")
    group = Path("/sys/fs/cgroup/cpu/ddps-slow-rank")
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text("5000")
    (group / "cgroup.procs").write_text(str(pid))
    try:
        d.wait_for(job, "the slow rank named", lambda: job.rows("slow"))
    finally:
        with contextlib.suppress(OSError):  # back to full speed, so that it checkpoints and stops in time
            Path("/sys/fs/cgroup/cpu/cgroup.procs").write_text(str(pid))
        d.cluster.cancel(job.job_id, "--signal=USR2")
        d.finish(job)
        with contextlib.suppress(OSError):
            group.rmdir()
    return {"job": job, "node": node}


def run_capped(d: Driver) -> dict[str, Any]:
    job = submit(
        d,
        Job("capped", d.workdir),
        3,
        "train.epochs=100",
        "slurm.restarts=1",
        "dist.timeout_s=30",
        sbatch=("--requeue", "--exclude=node4"),
    )
    _, first, _, _ = kill_mid_training(d, job, rank=1)
    d.wait_for(job, "the relaunch", lambda: len(job.rows("start")) == 2)
    d.wait_for(job, "training again", lambda: job.rows()[-1]["kind"] == "train")
    _, second, _, _ = kill_mid_training(d, job, rank=1)
    d.wait_for(job, "the requeue", lambda: d.cluster.job_info(job.job_id)["Restarts"] == "1")

    def excluded() -> dict[str, str] | None:  # set right after the requeue, while the job is pending
        info = d.cluster.job_info(job.job_id)
        listed = info.get("ExcNodeList", "(null)").replace("(null)", "")
        return info if listed and {first, second} <= set(expand_hostlist(listed)) else None

    requeued = d.wait_for(job, "the exclusion of both lost nodes", excluded)
    d.cluster.cancel(job.job_id)
    d.finish(job)
    return {"job": job, "lost": [first, second], "requeued": requeued}


@pytest.fixture(scope="module")
def scenarios(slurm_cluster, tmp_path_factory) -> dict[str, Any]:
    d = Driver(slurm_cluster, tmp_path_factory.mktemp("restart"))
    try:
        out = {"down": run_down(d), "drained": run_drained(d), "silent": run_silent(d), "headless": run_headless(d)}
        out["torchrun"] = run_torchrun(d)
        out["submitted"] = run_submitted(d)
        with ThreadPoolExecutor(max_workers=3, thread_name_prefix="restart-job") as pool:
            spare, capped, slowed = pool.submit(run_spare, d), pool.submit(run_capped, d), pool.submit(run_slowed, d)
            out |= {"spare": spare.result(), "capped": capped.result(), "slowed": slowed.result()}
        return out
    finally:
        for job in d.jobs:
            d.cluster.cancel(job.job_id)


def starts(job: Job) -> list[tuple[int, int]]:
    return [(r["world_size"], r["restart_in_allocation"]) for r in job.rows("start")]


def assert_relaunched(out: dict[str, Any], expected: list[tuple[int, int]], nodes: str) -> None:
    """The job kept running with Restarts=0 while its step was launched again on ``nodes``, and completed."""
    job = out["job"]
    assert out["during"]["JobState"] == "RUNNING" and out["during"]["Restarts"] == "0", out["during"]
    assert job.info["JobState"] == "COMPLETED", job.describe()
    assert starts(job) == expected, job.describe()
    n = len(nodes.split(","))
    assert f"relaunching training inside the allocation on {n} node(s) {nodes}" in job.text(), job.describe()
    assert job.rows()[-1]["kind"] == "end"


def test_a_node_set_down_the_step_runs_again_on_the_nodes_left_bit_identically(scenarios, tmp_path, record_property):
    out = scenarios["down"]
    job = out["job"]
    record_property("seconds_to_training_again", round(out["again"], 1))
    assert_relaunched(out, [(4, 0), (3, 1)], "node1,node2,node4")
    # The same run, resumed by hand at world size 3 from the checkpoint the relaunch took, on this machine.
    resumed_at = job.rows("start")[1]["step"]
    copy = tmp_path / "runs" / "down"
    shutil.copytree(job.run_dir, copy, symlinks=True)
    res = resume(copy, "--step", resumed_at, "--nproc-per-node", 3, env=base_env(OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr
    assert same_weights(job.run_dir, copy)


def test_the_batch_host_lost_silently_its_survivor_names_it_and_requeues_the_job_without_it(scenarios, record_property):
    """Its log died with node1 (the batch script's output goes through it): lost_nodes, the flight-recorder file the
    survivor wrote on node2, and Slurm's own record of the requeue tell it."""
    out = scenarios["headless"]
    job = out["job"]
    record_property("seconds_to_requeue", round(out["again"], 1))
    [line] = [line.split("\t") for line in (job.run_dir / "lost_nodes").read_text().splitlines()]
    assert (line[0], line[2], line[4]) == ("node1", "0", "1"), line
    assert re.fullmatch(
        r"lost rank 0 \(host node1, pid \d+, store at node1:\d+\): the rendezvous store it hosted does not answer "
        r"\(waited \d+ s\)",
        line[5],
    ), line
    assert out["requeued"]["Restarts"] == "1" and out["requeued"]["ExcNodeList"] == "node1", out["requeued"]
    dumped = traces(job, "0")
    assert set(dumped) == {1} and dumped[1]["ddp_slurm"]["verdict"] == line[5], dumped


def test_under_torchrun_the_agents_are_launched_again_on_the_nodes_left(scenarios):
    assert_relaunched(scenarios["torchrun"], [(3, 0), (2, 1)], "node1,node2")


def test_a_submit_job_is_launched_again_on_the_nodes_left(scenarios):
    assert_relaunched(scenarios["submitted"], [(3, 0), (2, 1)], "node1,node2")


def test_a_slowed_rank_is_named_with_its_host_and_a_quiet_run_names_nobody(scenarios):
    out = scenarios["slowed"]
    job, node = out["job"], out["node"]
    [slow] = job.rows("slow")
    assert (slow["rank"], slow["host"]) == (1, node) and slow["ratio"] > 5, slow
    assert f"rank 1 (host {node}) is slow: its compute per step took" in job.text(), job.describe()
    assert badnodes.excluded(job.run_dir, slow=True) == [node] and badnodes.excluded(job.run_dir) == []
    assert scenarios["drained"]["job"].rows("slow") == []


def test_a_spare_node_takes_the_lost_nodes_place(scenarios, record_property):
    out = scenarios["spare"]
    job, node = out["job"], out["node"]
    record_property("seconds_to_training_again", round(out["again"], 1))
    assert out["during"]["JobState"] == "RUNNING" and out["during"]["Restarts"] == "0", out["during"]
    assert starts(job) == [(3, 0), (3, 1)], job.describe()
    assert "spare node(s) node4" in job.text(), job.describe()
    [relaunch] = re.findall(r"relaunching training inside the allocation on 3 node\(s\) (\S+)", job.text())
    assert node not in relaunch.split(",") and "node4" in relaunch.split(","), relaunch
    assert badnodes.excluded(job.run_dir) == [node]
    assert job.rows()[-1]["kind"] == "stop" and job.info["ExitCode"].startswith("75:"), job.describe()
    assert_nothing_left(job)


def test_past_the_restart_cap_a_lost_node_requeues_the_job_without_it(scenarios):
    out = scenarios["capped"]
    job, lost = out["job"], out["lost"]
    assert starts(job)[:2] == [(3, 0), (2, 1)], job.describe()
    assert out["requeued"]["Restarts"] == "1", out["requeued"]
    assert set(expand_hostlist(out["requeued"]["ExcNodeList"])) >= set(lost), out["requeued"]
    assert badnodes.excluded(job.run_dir) == lost, job.describe()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[list[int]]:
    """The global batches of the run left alone: RANGED on 4 ranks (3 micro-batches per step), on this machine."""
    folder = tmp_path_factory.mktemp("reference")
    write_poison_task(folder)
    ref = folder / "runs" / "ref"
    cmd = Launcher(folder).cmd_torchrun(4, *RANGED, f"run.output_root={ref.parent}", "run.name=ref")
    res = Launcher(folder).run(cmd, env=base_env(OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    steps = global_batches(ref, 4, 3)
    assert len(steps) == 4800 // 48 and all(len(ids) == 48 for ids in steps), [len(ids) for ids in steps]
    return steps


def test_a_node_range_starts_on_the_nodes_free_and_keeps_every_global_batch(scenarios, reference):
    out = scenarios["drained"]
    job = out["job"]
    assert job.info["JobState"] == "COMPLETED", job.describe()
    assert expand_hostlist(out["during"]["NodeList"]) == ["node1", "node3", "node4"], out["during"]
    [start] = job.rows("start")
    assert (start["world_size"], start["accumulate"]) == (3, 4), start
    assert global_batches(job.run_dir, 3, 4) == reference


def traces(job: Job, launch: str) -> dict[int, dict[str, Any]]:
    """The flight-recorder files of one launch (``<job>.<launch>-rank<N>`` in the submit directory), by rank."""
    found = {}
    for path in (job.workdir / "nccl-traces").glob(f"{job.job_id}.{launch}-rank*"):
        found[int(path.name.rpartition("-rank")[2])] = pickle.loads(path.read_bytes())
    return found


@pytest.mark.parametrize(
    ("fault", "launch", "survivors"),
    [("frozen", "0", {0, 2, 3}), ("vanished", "0.1", {0, 2})],
    ids=["sigstop", "power_off"],
)
def test_a_silent_loss_is_named_recorded_and_trained_past_inside_the_allocation(
    scenarios, fault, launch, survivors, record_property
):
    """Neither a frozen rank nor a vanished node says a word; the survivors name it within seconds of the fault
    (dist.timeout_s is 300 s, Slurm's node timeout 30 s here), record its node, dump their flight recorder, and
    the job trains again on the nodes left: same job, Restarts=0."""
    out = scenarios["silent"]
    job, node = out["job"], out[fault]
    record_property("seconds_to_training_again", round(out[f"{fault}_again"], 1))
    text = job.text()
    assert out["during"]["JobState"] == "RUNNING" and out["during"]["Restarts"] == "0", out["during"]
    # every survivor, by the heartbeat: the stall verdict (before the stall deadline, a stuck rank's, long before the
    # backend's timeout), or that verdict as the cause of a collective that failed first. The frozen rank may say it
    # too: Slurm sends SIGCONT before it kills a step, and it sees the verdict.
    either = survivors | {1}
    lost = re.findall(
        rf"^.*ERROR \[rank (\d) node\d\] lost rank 1 \(host {node}, pid \d+\): no heartbeat for \d+ s; (.*)$",
        text,
        re.M,
    )
    assert survivors <= {int(r) for r, _ in lost} <= either, text
    waited = [
        re.match(r"this rank waited (\d+) s at step \d+ \(found before the backend's timeout\)", why) for _, why in lost
    ]
    assert any(waited) and all(int(w[1]) < stall.deadline_s(300) for w in waited if w), lost  # the stall verdict
    # recorded in lost_nodes under this launch, by each survivor before its os._exit (nothing else writes there)
    lines = [line.split("\t") for line in (job.run_dir / "lost_nodes").read_text().splitlines()]
    assert survivors <= {int(f[4]) for f in lines if f[0] == node and f[2] == launch} <= either, lines
    dumped = traces(job, launch)
    assert survivors <= set(dumped) <= either, sorted(dumped)
    analyser = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "--allow-incomplete-ranks"]
    res = subprocess.run(
        [*analyser, "-p", f"{job.job_id}.{launch}-rank", str(job.workdir / "nccl-traces")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]  # torch's own analyser reads them (gloo's groups named)
    for rank, trace in dumped.items():
        mine = trace["ddp_slurm"]
        assert mine["rank"] == rank and mine["verdict"].startswith(f"lost rank 1 (host {node}"), mine
        assert trace["entries"] and trace["entries"][-1]["profiling_name"].startswith("gloo:"), trace["entries"][-1:]
    if fault == "vanished":  # srun would wait for the dead node's task until Slurm gives the node up
        assert f"the survivors named {node} lost and left, but srun still waits for it" in text, job.describe()


def test_after_two_silent_losses_the_run_ends_with_the_global_batches_of_the_run_left_alone(scenarios, reference):
    out = scenarios["silent"]
    job = out["job"]
    assert job.info["JobState"] == "COMPLETED", job.describe()
    assert starts(job) == [(4, 0), (3, 1), (2, 2)], job.describe()
    assert badnodes.excluded(job.run_dir) == [out["frozen"], out["vanished"]], job.describe()
    relaunches = re.findall(r"relaunching training inside the allocation on \d node\(s\) (\S+)", job.text())
    assert [set(r.split(",")) for r in relaunches] == [
        {"node1", "node2", "node3", "node4"} - {out["frozen"]},
        {"node1", "node2", "node3", "node4"} - {out["frozen"], out["vanished"]},
    ], relaunches
    ports = re.findall(r"rank 0/\d joined .* process group at node\d:(\d+)", job.text())
    assert len(ports) == 3 and len(set(ports)) == 3, ports  # each launch its own MASTER_PORT
    # each launch's steps from its start up to the next launch's resume, as the run left alone trained them
    first, second = (r["step"] for r in job.rows("start")[1:])
    steps = global_batches(job.run_dir, 4, 3)[:first] + global_batches(job.run_dir, 3, 4)[: second - first]
    steps += global_batches(job.run_dir, 2, 6)
    assert steps == reference
