"""End to end: the project's sbatch scripts on the real multi-node test cluster.

Six jobs run side by side (two 4-node jobs of one CPU per node fit the cluster at once; Slurm
queues the rest), each driven by a thread that submits it, interrupts it where its scenario says
and releases every requeued run at once instead of waiting out Slurm's requeue delay:

``ref_cnn``        sbatch/mnist_4node.sh, the sample's default training (cnn): 4 ranks on 4 nodes,
                   >= 96% test accuracy, exit 0.
``time_limit``     the same script, a longer training, ``--time=2 --signal=USR2@60``: Slurm's own
                   warning before the time limit stops it, rank 0 requeues it, every run resumes
                   where the last one stopped; the final weights are bit-identical to those of
``ref_long``       the same job without a time limit.
``ref_torchrun``   sbatch/mnist_torchrun.sh (4 nodes x 1 agent x 1 worker), mlp: >= 89%, exit 0.
                   Reference for ``usr2_torchrun``.
``usr2_torchrun``  the same job, ``scancel --signal=USR2`` mid-training: the agents survive and
                   pass the signal on, rank 0 checkpoints and requeues, the job resumes and ends
                   bit-identical to ``ref_torchrun``.
``sigterm_2node``  ``sbatch --nodes=2 sbatch/mnist_4node.sh`` (mlp); ``scontrol requeue`` from
                   outside mid-training (SIGTERM, as a preemption sends): checkpoint at the stop
                   step, Slurm requeues, the restart resumes from that step, no step trained twice.

Every run uses one thread per rank (``--cpus-per-task=1``), so reruns are bit-for-bit repeatable.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ddp_slurm import config
from ddp_slurm.bootstrap import expand_hostlist
from ddp_slurm.slurmjob.slurm import ENDED_STATES
from ddp_slurm.tasks.mnist import data
from ddp_slurm.train import checkpoint, loader

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SAMPLE = str(REPO / "jobs" / "mnist_sample.yaml")
# One rank per node, one CPU each: small enough that two 4-node jobs share the cluster.
PER_NODE = ["--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1"]
_SAMPLE_CFG = config.load(Path(SAMPLE))
# The sample's default training in optimizer steps (no job here caps it), read from the file so it
# follows the defaults.
STEPS_PER_EPOCH = loader.steps_per_epoch(data.TRAIN_SIZES["sample"], _SAMPLE_CFG.train.global_batch_size)
SAMPLE_STEPS = _SAMPLE_CFG.train.epochs * STEPS_PER_EPOCH
# Slurm checks time limits every 30 s and sends the --signal warning up to 30 s early: with
# --time=2 --signal=USR2@60 it comes 30-60 s after a run starts. The time-limit job must still be
# training then, also on a fast machine, hence a longer training than the default for that pair.
LONG_EPOCHS = 25
TERMINAL = ENDED_STATES  # Slurm will not run the job again
JOB_TIMEOUT_S = 900.0  # per job, all its runs together: generous for 2 busy cores


class Aborted(RuntimeError):
    """The module is being torn down: drivers stop waiting."""


@dataclasses.dataclass
class Job:
    """One sbatch submission of a project script and everything needed to judge it afterwards."""

    name: str
    script: str  # file under sbatch/
    sbatch_args: list[str]
    train_args: list[str]
    workdir: Path
    steps: int = SAMPLE_STEPS  # optimizer steps of the whole training
    job_id: str = ""
    info: dict[str, str] = dataclasses.field(default_factory=dict)  # scontrol's record at the end

    @property
    def run_dir(self) -> Path:
        return self.workdir / "runs" / self.name

    @property
    def log(self) -> Path:
        """Where the script's ``--output=%x-%j.out`` puts it: the submit directory."""
        job_name = {"mnist_4node.sh": "mnist-4node", "mnist_torchrun.sh": "mnist-torchrun"}[self.script]
        return self.workdir / f"{job_name}-{self.job_id}.out"

    def rows(self, kind: str | None = None) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                continue
        return [r for r in rows if kind is None or r["kind"] == kind]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.job_id and self.log.exists() else ""

    def describe(self) -> str:
        return (
            f"job {self.name} ({self.job_id}): {self.info or '(no record)'}\n--- log {self.log}\n"
            f"{self.log_text()[-6000:]}\n--- metrics\n" + "\n".join(map(str, self.rows()[-12:]))
        )


class Driver:
    """Submits jobs and moves them along; one instance per module, used from several threads."""

    def __init__(self, cluster, workdir: Path) -> None:
        env = dict(cluster.env)
        # The scripts run `python` from PATH, which sbatch carries into the job: the venv's first.
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env["PYTHONUNBUFFERED"] = "1"
        for name in ("OMP_NUM_THREADS", "DDP_SLURM_PYTHON", "DDP_SLURM_NPROC_PER_NODE", "PYTHONPATH"):
            env.pop(name, None)  # the scripts work these out themselves
        self.cluster = dataclasses.replace(cluster, env=env)
        self.workdir = workdir
        self.abort = threading.Event()
        self.submitted: list[Job] = []

    def job(
        self, name: str, script: str, sbatch_args: list[str], train_args: list[str], epochs: int | None = None
    ) -> Job:
        args = [f"run.output_root={self.workdir / 'runs'}", f"run.name={name}", *train_args]
        if epochs is None:
            return Job(name, script, sbatch_args, args, self.workdir)
        return Job(
            name, script, sbatch_args, [*args, f"train.epochs={epochs}"], self.workdir, steps=epochs * STEPS_PER_EPOCH
        )

    def submit(self, job: Job) -> Job:
        # Submitted from the work directory, not the repository: the scripts must find the project.
        job.job_id = self.cluster.sbatch(
            [*job.sbatch_args, str(REPO / "sbatch" / job.script), "--config", SAMPLE, *job.train_args], cwd=self.workdir
        )
        self.submitted.append(job)
        return job

    def wait_for(self, job: Job, what: str, check: Callable[[], Any], timeout: float = JOB_TIMEOUT_S) -> Any:
        """Poll ``check()`` until it returns something truthy; fails if the job ends first."""
        deadline = time.monotonic() + timeout
        while True:
            if self.abort.is_set():
                raise Aborted(job.name)
            found = check()
            if found:
                return found
            info = self.cluster.job_info(job.job_id)
            if info["JobState"] in TERMINAL:
                job.info = info
                raise AssertionError(f"job ended before {what}\n{job.describe()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout:.0f} s\n{job.describe()}")
            time.sleep(0.2)

    def finish(self, job: Job, timeout: float = JOB_TIMEOUT_S) -> Job:
        """Wait for the job's end, releasing each requeued run at once; returns the job with ``info``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.abort.is_set():
                raise Aborted(job.name)
            info = self.cluster.job_info(job.job_id)
            if info["JobState"] in TERMINAL:
                job.info = info
                return job
            if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime" and info.get("Restarts", "0") != "0":
                try:  # requeued: start it now rather than after the requeue delay
                    self.cluster.release(job.job_id)
                except RuntimeError:  # it started on its own meanwhile: nothing to release
                    if self.cluster.job_info(job.job_id)["JobState"] == "PENDING":
                        raise
            if time.monotonic() > deadline:
                job.info = info
                raise TimeoutError(f"job not finished after {timeout:.0f} s\n{job.describe()}")
            time.sleep(0.5)

    def training_underway(self, job: Job, restart: int) -> Callable[[], bool]:
        """True once run ``restart`` of the job has logged its first training window."""

        def check() -> bool:
            starts = [i for i, r in enumerate(job.rows()) if r["kind"] == "start" and r["restart_count"] == restart]
            return bool(starts) and any(r["kind"] == "train" for r in job.rows()[starts[-1] :])

        return check

    def cancel_all(self) -> None:
        self.abort.set()
        for job in self.submitted:
            if job.job_id:
                self.cluster.run(["scancel", job.job_id], timeout=30)


# ---------------------------------------------------------------------------------------------- scenarios
def run_plain(d: Driver, job: Job) -> Job:
    return d.finish(d.submit(job))


def run_scancel_usr2(d: Driver, job: Job) -> Job:
    d.submit(job)
    d.wait_for(job, "training", d.training_underway(job, restart=0))
    d.cluster.cancel(job.job_id, "--signal=USR2")  # to every process of the job's steps, as Slurm's warning
    return d.finish(job)


def run_scontrol_requeue(d: Driver, job: Job) -> Job:
    d.submit(job)
    d.wait_for(job, "training", d.training_underway(job, restart=0))
    d.cluster.run(["scontrol", "requeue", job.job_id], check=True, timeout=30)  # SIGTERM, then a requeue
    return d.finish(job)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> dict[str, Future]:
    """All scenarios, started together; each test waits for the one it judges."""
    d = Driver(slurm_cluster, tmp_path_factory.mktemp("sbatch"))
    four_node, mlp = ["--nodes=4", *PER_NODE], ["model.name=mlp"]
    plan = {  # submission order: the time-limit pair first, side by side, so they slow each other equally
        "time_limit": (
            run_plain,
            d.job("time_limit", "mnist_4node.sh", [*four_node, "--time=2", "--signal=USR2@60"], [], epochs=LONG_EPOCHS),
        ),
        "ref_long": (run_plain, d.job("ref_long", "mnist_4node.sh", four_node, [], epochs=LONG_EPOCHS)),
        "ref_cnn": (run_plain, d.job("ref_cnn", "mnist_4node.sh", four_node, [])),
        "ref_torchrun": (run_plain, d.job("ref_torchrun", "mnist_torchrun.sh", four_node, mlp)),
        "usr2_torchrun": (run_scancel_usr2, d.job("usr2_torchrun", "mnist_torchrun.sh", four_node, mlp)),
        "sigterm_2node": (
            run_scontrol_requeue,
            d.job("sigterm_2node", "mnist_4node.sh", ["--nodes=2", *PER_NODE], mlp),
        ),
    }
    yield from started(d, plan)


def started(d: Driver, plan: dict[str, tuple]) -> Iterator[dict[str, Future]]:
    """The scenarios of ``plan`` (name: (scenario, job)) started side by side, in its order (Slurm's job
    ids follow it); on the way out, whatever still runs is cancelled."""
    pool = ThreadPoolExecutor(max_workers=len(plan), thread_name_prefix="slurm-job")
    futures = {}
    for name, (scenario, job) in plan.items():
        futures[name] = pool.submit(scenario, d, job)
        time.sleep(0.5)  # keep Slurm's job ids in the order of the plan
    try:
        yield futures
    finally:
        if not all(f.done() for f in futures.values()):
            d.cancel_all()
        pool.shutdown(wait=True)


def result(jobs: dict[str, Future], name: str) -> Job:
    return jobs[name].result(timeout=JOB_TIMEOUT_S + 120)


# ---------------------------------------------------------------------------------------------- checks
def rank_hosts(job: Job) -> dict[int, str]:
    """rank -> host from rank 0's one-line rank map in the log (the last run's)."""
    lines = re.findall(r"ranks by host \((\d+) ranks?, \d+ hosts?\): (.*)", job.log_text())
    assert lines, f"no rank map in the log\n{job.describe()}"
    hosts: dict[int, str] = {}
    for group in lines[-1][1].split("; "):
        host, _, ranks = group.partition(": ")
        for part in ranks.split(","):
            low, _, high = part.partition("-")
            hosts.update({r: host for r in range(int(low), int(high or low) + 1)})
    assert len(hosts) == int(lines[-1][0])
    return hosts


def job_nodelists(job: Job) -> list[str]:
    """SLURM_JOB_NODELIST of each run, from the script's first line per run."""
    return re.findall(r"^job \d+ restart \d+ on \d+ node\(s\): (\S+);", job.log_text(), re.M)


def assert_completed(job: Job, restarts: int | None = None) -> None:
    assert job.info["JobState"] == "COMPLETED", job.describe()
    assert job.info["ExitCode"] == "0:0", job.describe()
    if restarts is not None:
        assert job.info["Restarts"] == str(restarts), job.describe()
    end = job.rows("end")
    assert len(end) == 1 and end[0]["step"] == job.steps, job.describe()


def assert_resumed_exactly(job: Job) -> list[dict[str, Any]]:
    """Every run after the first started where the previous one stopped; no step was trained twice."""
    rows = job.rows()
    starts = [i for i, r in enumerate(rows) if r["kind"] == "start"]
    stops = [r for r in rows if r["kind"] == "stop"]
    assert len(starts) == int(job.info["Restarts"]) + 1 == len(stops) + 1, job.describe()
    assert rows[starts[0]]["resumed"] is False and rows[starts[0]]["step"] == 0
    for n, (i, stop) in enumerate(zip(starts[1:], stops), start=1):
        start = rows[i]
        assert rows[i - 1] == stop, f"run {n} did not end with its stop line\n{job.describe()}"
        assert start["resumed"] is True and start["restart_count"] == n, job.describe()
        assert start["step"] == stop["step"], f"run {n} resumed at {start['step']}, not at {stop['step']}"
    # Mid-training. (A time-limit warning may also land between start-up and the first step of a
    # run: a clean stop at that run's first step, which is fine but proves less.)
    assert any(0 < s["step"] < job.steps for s in stops), f"no stop mid-training\n{job.describe()}"
    train_steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert train_steps == sorted(set(train_steps)), f"steps trained twice: {train_steps}"
    return stops


def assert_same_weights(job: Job, reference: Job) -> None:
    mine, ref = checkpoint.load_latest(job.run_dir), checkpoint.load_latest(reference.run_dir)
    assert mine is not None and ref is not None
    assert mine["finished"] and ref["finished"] and mine["step"] == ref["step"] == job.steps == reference.steps
    assert mine["model"].keys() == ref["model"].keys()
    differ = [k for k in ref["model"] if not mine["model"][k].equal(ref["model"][k])]
    assert not differ, f"{job.name} differs from {reference.name} in {differ}"


# ---------------------------------------------------------------------------------------------- tests
def test_expand_hostlist_agrees_with_scontrol(slurm_cluster):
    """The node lists Slurm gives a job, and a few other shapes, expand like `scontrol show hostnames`."""
    # A real, non-contiguous allocation: its node list as the job's own environment has it.
    cp = slurm_cluster.run(
        [
            "srun",
            "-N3",
            "--exclude=node2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            "bash",
            "-c",
            "echo $SLURM_JOB_NODELIST $SLURM_STEP_NODELIST",
        ],
        check=True,
        timeout=300,
    )
    captured = set(cp.stdout.split())
    assert captured == {"node[1,3-4]"}, cp.stdout
    variants = [
        *captured,
        "node[1-4]",
        "node[1-2],node4",
        "node1,node3",
        "node[4,1-2]",
        "node[01-04]",
        "node[008-011],node2",
        "n[9-11],node[3]",
    ]
    for text in variants:
        want = slurm_cluster.run(["scontrol", "show", "hostnames", text], check=True).stdout.split()
        assert expand_hostlist(text) == want, text


def test_srun_script_4_nodes_cnn_accuracy(jobs, slurm_cluster):
    job = result(jobs, "ref_cnn")
    assert_completed(job, restarts=0)
    hosts = rank_hosts(job)
    assert sorted(hosts.values()) == sorted(slurm_cluster.nodes), hosts  # 4 ranks, one per node
    assert sorted(expand_hostlist(job_nodelists(job)[0])) == sorted(slurm_cluster.nodes)
    start = job.rows("start")[0]
    assert (start["world_size"], start["launcher"]) == (4, "slurm")
    final = job.rows("eval")[-1]
    assert final["accuracy"] >= 0.96 and final["test_samples"] == 5000, final
    assert job.rows("train")[-1]["world_size"] == 4


def test_torchrun_script_4_agents(jobs, slurm_cluster):
    job = result(jobs, "ref_torchrun")
    assert_completed(job, restarts=0)
    hosts = rank_hosts(job)
    assert sorted(hosts.values()) == sorted(slurm_cluster.nodes), hosts
    start = job.rows("start")[0]
    assert (start["world_size"], start["launcher"]) == (4, "torchrun")
    final = job.rows("eval")[-1]
    assert final["accuracy"] >= 0.89 and final["test_samples"] == 5000, final


def test_scancel_usr2_reaches_torchrun_workers_and_requeues(jobs):
    job, ref = result(jobs, "usr2_torchrun"), result(jobs, "ref_torchrun")
    assert_completed(job, restarts=1)
    [stop] = assert_resumed_exactly(job)
    assert stop["requeue"] is True  # USR2: rank 0 requeued the job itself
    log = job.log_text()
    # every agent survived the signal and passed it on to its worker
    assert log.count("SIGUSR2 passed on to 1 worker process(es)") == 4, job.describe()
    assert "restart 0 on 4 node(s)" in log and "restart 1 on 4 node(s)" in log  # one log, appended
    assert_same_weights(job, ref)


def test_scontrol_requeue_sigterm_resumes_without_double_work(jobs):
    job = result(jobs, "sigterm_2node")
    assert_completed(job, restarts=1)
    [stop] = assert_resumed_exactly(job)
    assert stop["requeue"] is False  # SIGTERM: Slurm requeued it, the training did not
    assert checkpoint.list_checkpoints(job.run_dir)  # the run kept its checkpoints
    assert len(set(rank_hosts(job).values())) == 2  # `sbatch --nodes=2` on the 4-node script
    assert [r["world_size"] for r in job.rows("start")] == [2, 2]


def test_time_limit_signal_requeues_and_resumes_bit_identical(jobs):
    job, ref = result(jobs, "time_limit"), result(jobs, "ref_long")
    assert_completed(ref, restarts=0)
    assert_completed(job)
    assert int(job.info["Restarts"]) >= 1, f"the time-limit warning never came\n{job.describe()}"
    stops = assert_resumed_exactly(job)
    assert all(s["requeue"] for s in stops), stops  # each stop was the USR2 warning, so rank 0 requeued
    assert len(job_nodelists(job)) == len(stops) + 1  # --open-mode=append kept every run's output
    assert_same_weights(job, ref)


# ---------------------------------------------------------------------------------------------- dist.strategy=fsdp
# Three jobs of their own fixture (``-k fsdp`` runs only them), mlp for one epoch: FSDP2 over 4 nodes,
# a SIGUSR2 + requeue that ends bit-identical to the run left alone, and a 4-rank sharded checkpoint
# resumed by a 2-node job of the same run.
FSDP = ["model.name=mlp", "dist.strategy=fsdp", "checkpoint.every_steps=10"]


def run_usr2_then_two_nodes(d: Driver, job: Job) -> Job:
    """4 nodes until SIGUSR2 (no requeue: ``slurm.requeue=false``), then the same run as a 2-node job."""
    d.submit(job)
    d.wait_for(job, "training", d.training_underway(job, restart=0))
    d.cluster.cancel(job.job_id, "--signal=USR2")
    d.finish(job)
    job.sbatch_args = ["--nodes=2", *PER_NODE]
    return d.finish(d.submit(job))


@pytest.fixture(scope="module")
def fsdp_jobs(slurm_cluster, tmp_path_factory) -> dict[str, Future]:
    d = Driver(slurm_cluster, tmp_path_factory.mktemp("sbatch-fsdp"))
    four_node = ["--nodes=4", *PER_NODE]
    plan = {
        "fsdp_ref": (run_plain, d.job("fsdp_ref", "mnist_4node.sh", four_node, FSDP, epochs=1)),
        "fsdp_usr2": (run_scancel_usr2, d.job("fsdp_usr2", "mnist_4node.sh", four_node, FSDP, epochs=1)),
        "fsdp_resize": (
            run_usr2_then_two_nodes,
            d.job("fsdp_resize", "mnist_4node.sh", four_node, [*FSDP, "slurm.requeue=false"], epochs=1),
        ),
    }
    yield from started(d, plan)


def test_fsdp_trains_on_4_nodes_and_requeue_ends_bit_identical(fsdp_jobs):
    ref, job = result(fsdp_jobs, "fsdp_ref"), result(fsdp_jobs, "fsdp_usr2")
    assert_completed(ref, restarts=0)
    assert ref.rows("start")[0]["world_size"] == 4 and ref.rows("eval")[-1]["accuracy"] >= 0.85
    assert (ref.run_dir / "checkpoints" / f"step-{ref.steps}" / "__3_0.distcp").exists()  # one shard per rank
    assert_completed(job, restarts=1)
    [stop] = assert_resumed_exactly(job)
    assert stop["requeue"] is True
    assert_same_weights(job, ref)


def test_fsdp_checkpoint_of_4_ranks_resumes_on_2_nodes(fsdp_jobs):
    job = result(fsdp_jobs, "fsdp_resize")
    assert_completed(job)
    starts, stops = job.rows("start"), job.rows("stop")
    assert [s["world_size"] for s in starts] == [4, 2] and len(stops) == 1, job.describe()
    assert stops[0]["requeue"] is True and 0 < stops[0]["step"] < job.steps  # USR2; slurm.requeue=false
    assert starts[1]["resumed"] is True and starts[1]["step"] == stops[0]["step"]
    assert "from a sharded checkpoint of world size 4" in job.log_text(), job.describe()
    final = checkpoint.load_latest(job.run_dir)
    assert final is not None and final["finished"] and final["world_size"] == 2
