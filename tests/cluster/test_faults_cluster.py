"""Fault injection on the real multi-node test cluster: ranks that die and ranks that never come.

Five jobs start together (module fixture); each test drives and judges one of them:

``killed_srun``   the project's sbatch/mnist_4node.sh on 2 nodes (srun --kill-on-bad-exit=1, --no-kill):
                  rank 1 is SIGKILLed mid-training. Slurm ends the step and names the task (= rank) that
                  died, the survivor names its node, and the script's supervisor relaunches the step on the
                  node left from the newest checkpoint: the same job, Restarts=0, no queue wait.
``killed_plain``  4 ranks on 2 nodes under a plain ``srun`` (no --kill-on-bad-exit, Slurm's default):
                  rank 2 is SIGKILLed. Every survivor exits on its own within dist.timeout_s + 30 s,
                  each naming rank 2, its host and pid, in one line; nothing is left running.
``killed_store``  the same with 2 ranks, and rank 0 killed: the rendezvous store (hosted by rank 0
                  under srun) dies with it; the survivor says so, naming rank 0 and its node.
``few_ranks``     a hand-written launch line exports WORLD_SIZE for the 2 tasks of the allocation but
                  starts ``srun --ntasks=1``: rank 0 gives up after dist.timeout_s with "expected 2
                  ranks, 1 arrived" instead of hanging.
``capped``        the project's script with slurm.max_requeues=0 gets ``scancel --signal=USR2``: it
                  checkpoints, says the cap is reached, exits 3; the job ends FAILED, not requeued.

Processes are found from this machine through /proc (the nodes share its process table): a rank is
the process whose environment has the job's SLURM_JOB_ID and its SLURM_PROCID.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import helpers
import pytest

from ddp_slurm.bootstrap import expand_hostlist
from ddp_slurm.slurmjob import badnodes
from ddp_slurm.slurmjob.slurm import ENDED_STATES
from ddp_slurm.train import checkpoint, metrics

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SAMPLE = str(REPO / "jobs" / "mnist_sample.yaml")
TERMINAL = ENDED_STATES  # Slurm will not run the job again
JOB_TIMEOUT_S = 600.0  # per job: generous for a shared, busy machine; never a timing assertion by itself
EVERY = 10
TRAIN = [
    "model.name=mlp",
    "train.epochs=100",
    "train.log_every_steps=1",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep=3",
    "slurm.requeue=false",
]


@dataclasses.dataclass
class Job:
    name: str
    workdir: Path
    job_id: str = ""
    info: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return self.workdir / "runs" / self.name

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}-{self.job_id}.out"

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def rows(self, kind: str | None = None) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        rows = list(metrics.read(path)) if path.exists() else []
        return [r for r in rows if kind is None or r["kind"] == kind]

    def describe(self) -> str:
        return f"job {self.name} ({self.job_id}): {self.info}\n--- log {self.log}\n{self.text()[-6000:]}"


class Driver:
    def __init__(self, cluster, workdir: Path) -> None:
        env = dict(cluster.env)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # the scripts run `python`
        env["PYTHONUNBUFFERED"] = "1"
        for name in ("OMP_NUM_THREADS", "DDP_SLURM_PYTHON", "PYTHONPATH"):
            env.pop(name, None)
        self.cluster = dataclasses.replace(cluster, env=env)
        self.workdir = workdir
        self.jobs: list[Job] = []

    def submit(self, job: Job, args: list[str]) -> Job:
        job.job_id = self.cluster.sbatch(
            ["--job-name", job.name, "-o", f"{job.name}-%j.out", "--open-mode=append", *args], cwd=self.workdir
        )
        self.jobs.append(job)
        return job

    def wait_for(self, job: Job, what: str, check: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (found := check()):
            info = self.cluster.job_info(job.job_id)
            if info["JobState"] in TERMINAL:
                job.info = info
                raise AssertionError(f"job ended before {what}\n{job.describe()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {JOB_TIMEOUT_S:.0f} s\n{job.describe()}")
            time.sleep(0.1)
        return found

    def finish(self, job: Job) -> Job:
        job.info = self.cluster.wait_state(job.job_id, TERMINAL, timeout=JOB_TIMEOUT_S, poll=0.3)
        return job


# ---------------------------------------------------------------------------------------------- processes
def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def job_processes(job_id: str) -> dict[int, dict[str, str]]:
    """Live (non-zombie) processes of a job's steps: pid -> environment."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        env = environ_of(int(entry.name))
        if env.get("SLURM_JOB_ID") != job_id or "SLURM_PROCID" not in env:
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found[int(entry.name)] = env
        except OSError:
            continue
    return found


def training_rank(job_id: str, rank: int) -> int | None:
    """The pid of the training process of ``rank`` in the job, once it is running."""
    for pid, env in job_processes(job_id).items():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        argv = cmd.split(b"\0")
        if env.get("SLURM_PROCID") == str(rank) and b"python" in argv[0] and b"ddp_slurm.train" in argv:
            return pid  # the training process itself, not the srun client that launched it
    return None


def assert_nothing_left(job: Job) -> None:
    deadline = time.monotonic() + 30
    while job_processes(job.job_id) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not job_processes(job.job_id), f"left running: {sorted(job_processes(job.job_id))}\n{job.describe()}"


def assert_checkpoints_intact(before: dict[str, str], run_dir: Path) -> None:
    """Nothing finished was lost: each earlier checkpoint is byte-identical, or pruned by a newer valid one."""
    now = helpers.checkpoint_files(run_dir)
    newest = checkpoint.latest(run_dir)
    assert newest is not None
    for name, digest in before.items():
        if name in now:
            assert now[name] == digest, f"{name} changed"
        else:
            assert int(name[5:-3]) < newest[1]["step"], f"{name} is gone with nothing newer"


# ---------------------------------------------------------------------------------------------- scenarios
def kill_mid_training(d: Driver, job: Job, rank: int) -> tuple[int, str, dict[str, str], float]:
    """Wait for two checkpoints, SIGKILL ``rank``; returns (pid, its node, checkpoints at the kill, monotonic time)."""
    d.wait_for(job, "two checkpoints", lambda: len(checkpoint.list_checkpoints(job.run_dir)) >= 2)
    pid = d.wait_for(job, f"rank {rank}'s process", lambda: training_rank(job.job_id, rank))
    node = environ_of(pid).get("SLURMD_NODENAME", "?")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    # listed after the kill: hashing them before it gave training time to write newer ones than those listed (the
    # relaunch then resumed from a step the test had not seen); after it, only a write in flight can still finish
    return pid, node, helpers.checkpoint_files(job.run_dir), killed


def run_killed_srun(d: Driver) -> dict[str, Any]:
    job = Job("killed_srun", d.workdir)
    sbatch = [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=1",
        "--cpus-per-task=1",
        str(REPO / "sbatch" / "mnist_4node.sh"),
        "--config",
        SAMPLE,
        f"run.output_root={d.workdir / 'runs'}",
        f"run.name={job.name}",
        *TRAIN,
        "dist.timeout_s=30",
    ]
    d.submit(job, sbatch)
    pid, node, before, killed = kill_mid_training(d, job, rank=1)
    d.wait_for(job, "the relaunch", lambda: len(job.rows("start")) == 2)
    d.wait_for(job, "a training step after the relaunch", lambda: job.rows()[-1]["kind"] == "train")
    again = time.monotonic() - killed  # from the kill to training again, inside the same allocation
    during = d.cluster.job_info(job.job_id)
    d.cluster.cancel(job.job_id, "--signal=USR2")
    d.finish(job)
    assert_nothing_left(job)
    return {"job": job, "during": during, "pid": pid, "node": node, "again": again, "before": before}


PLAIN = """\
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node={per_node} --cpus-per-task=1
# srun without --kill-on-bad-exit (Slurm's default): each rank finds out by itself that one is gone.
export OMP_NUM_THREADS=1
srun "{python}" -m ddp_slurm.train --config "{sample}" {args}
status=$?
echo "srun exited $status"
exit $status
"""


def run_killed_plain(d: Driver, name: str = "killed_plain", per_node: int = 2, victim: int = 2) -> dict[str, Any]:
    job = Job(name, d.workdir)
    script = d.workdir / f"{name}.sh"
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={job.name}", *TRAIN, "dist.timeout_s=30"]
    script.write_text(PLAIN.format(per_node=per_node, python=sys.executable, sample=SAMPLE, args=" ".join(args)))
    d.submit(job, [str(script)])
    pid, node, before, killed = kill_mid_training(d, job, rank=victim)
    d.finish(job)
    took = time.monotonic() - killed
    assert_nothing_left(job)
    assert_checkpoints_intact(before, job.run_dir)
    return {"job": job, "pid": pid, "node": node, "took": took}


def run_lost_node(d: Driver) -> dict[str, Any]:
    """2 nodes x 1 rank with requeue on: rank 1 is SIGKILLed. Rank 0 names its node, records it in the run
    directory, requeues the job and excludes the node from it; released at once, the job resumes elsewhere."""
    job = Job("lost_node", d.workdir)
    script = d.workdir / "lost_node.sh"
    train = [a for a in TRAIN if a != "slurm.requeue=false"]
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={job.name}", *train, "dist.timeout_s=30"]
    text = PLAIN.format(per_node=1, python=sys.executable, sample=SAMPLE, args=" ".join(args))
    script.write_text(text.replace("#SBATCH --nodes", "#SBATCH --requeue --nodes"))
    d.submit(job, [str(script)])
    pid, node, _, _ = kill_mid_training(d, job, rank=1)
    first = d.wait_for(job, "the requeue", lambda: (i := d.cluster.job_info(job.job_id))["Restarts"] == "1" and i)
    excluded = d.wait_for(
        job, "the exclusion", lambda: d.cluster.job_info(job.job_id).get("ExcNodeList", "(null)").replace("(null)", "")
    )
    # release(), not a bare StartTime=now: it waits out the requeue's 1-second credential revocation, which a
    # job restarted within the same second meets as "Job credential revoked" (FAILED, exit 168)
    d.cluster.release(job.job_id)
    d.wait_for(job, "the resumed run", lambda: len([r for r in job.rows() if r["kind"] == "start"]) == 2)
    second = d.cluster.job_info(job.job_id)
    d.cluster.run(["scancel", job.job_id], timeout=30)
    d.finish(job)
    return {"job": job, "node": node, "first": first, "excluded": excluded, "second": second}


FEW_RANKS = """\
#!/bin/bash
#SBATCH --nodes=1 --ntasks=2 --cpus-per-task=1
# A hand-written launch line: torchrun-style variables for the allocation's {{SLURM_NTASKS}} tasks...
export MASTER_ADDR=$(hostname) MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000)) WORLD_SIZE=$SLURM_NTASKS OMP_NUM_THREADS=1
# ...but only one task is started (the mistake).
srun --ntasks=1 bash -c 'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=$WORLD_SIZE \\
    exec "{python}" -m ddp_slurm.train --config "{sample}" {args}'
status=$?
echo "srun exited $status"
exit $status
"""


def run_few_ranks(d: Driver) -> dict[str, Any]:
    job = Job("few_ranks", d.workdir)
    script = d.workdir / "few.sh"
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={job.name}", *TRAIN, "dist.timeout_s=20"]
    script.write_text(FEW_RANKS.format(python=sys.executable, sample=SAMPLE, args=" ".join(args)))
    d.submit(job, [str(script)])
    d.finish(job)
    assert_nothing_left(job)
    return {"job": job}


def stop_after_a_checkpoint(d: Driver, job: Job, sbatch: Sequence[str] = (), train: Sequence[str] = ()) -> None:
    """The project's script on one node, requeue on (``sbatch``, ``train``: options added), gets Slurm's
    stop signal once it has a checkpoint; returns when the job has ended."""
    d.submit(
        job,
        [
            *sbatch,
            "--nodes=1",
            "--ntasks-per-node=1",
            "--gpus-per-node=1",
            "--cpus-per-task=1",
            str(REPO / "sbatch" / "mnist_4node.sh"),
            "--config",
            SAMPLE,
            f"run.output_root={d.workdir / 'runs'}",
            f"run.name={job.name}",
            *[a for a in TRAIN if a != "slurm.requeue=false"],
            *train,
        ],
    )
    d.wait_for(job, "a checkpoint", lambda: checkpoint.list_checkpoints(job.run_dir))
    d.cluster.cancel(job.job_id, "--signal=USR2")
    d.finish(job)


def run_capped(d: Driver) -> dict[str, Any]:
    """The project's script, already at its requeue cap (slurm.max_requeues=0), gets Slurm's stop signal."""
    job = Job("capped", d.workdir)
    stop_after_a_checkpoint(d, job, train=["slurm.max_requeues=0"])
    time.sleep(2)  # a requeue would show now as PENDING
    job.info = d.cluster.job_info(job.job_id)
    return {"job": job}


def run_chained(d: Driver) -> dict[str, Any]:
    """The project's script submitted with --no-requeue (a site that forbids requeueing) gets the stop
    signal: `scontrol requeue` is refused, so rank 0 chains a successor job (slurm.requeue_mode=auto)
    that starts once this one has ended and resumes the run."""
    job = Job("chained", d.workdir)
    stop_after_a_checkpoint(d, job, sbatch=["--no-requeue"])
    ended = d.cluster.job_info(job.job_id)["EndTime"]
    new = d.wait_for(job, "the chained job", lambda: (m := re.search(r"chained job (\d+)", job.text())) and m[1])
    nxt = Job("chained", d.workdir, job_id=new)
    d.jobs.append(nxt)
    try:
        d.wait_for(nxt, "the resumed run", lambda: len([r for r in job.rows() if r["kind"] == "start"]) == 2)
    except AssertionError as exc:  # the successor writes to the first job's log
        raise AssertionError(f"{exc}\n--- the chain's log\n{job.text()[-5000:]}") from None
    # Slurm drops a satisfied dependency from `scontrol show job` soon after the first job ends, so
    # the option is read where it stays: sbatch exports it to the successor's environment.
    pid = d.wait_for(nxt, "the successor's rank 0", lambda: training_rank(new, 0))
    depends = environ_of(pid).get("SLURM_JOB_DEPENDENCY", "")
    started = d.cluster.job_info(new)["StartTime"]
    d.cluster.run(["scancel", new], timeout=30)
    d.finish(nxt)
    return {"job": job, "next": nxt, "depends": depends, "ended": ended, "started": started}


@pytest.fixture(scope="module")
def scenarios(slurm_cluster, tmp_path_factory) -> Iterator[dict[str, Future]]:
    d = Driver(slurm_cluster, tmp_path_factory.mktemp("faults"))
    plan = {
        "killed_srun": run_killed_srun,
        "killed_plain": run_killed_plain,
        "few_ranks": run_few_ranks,
        "capped": run_capped,
        "killed_store": lambda d: run_killed_plain(d, "killed_store", per_node=1, victim=0),
        "lost_node": run_lost_node,
        "chained": run_chained,
    }
    pool = ThreadPoolExecutor(max_workers=len(plan), thread_name_prefix="fault-job")
    futures = {name: pool.submit(fn, d) for name, fn in plan.items()}
    try:
        yield futures
    finally:
        for job in d.jobs:
            if job.job_id and slurm_cluster.job_info(job.job_id)["JobState"] not in TERMINAL:
                slurm_cluster.run(["scancel", job.job_id], timeout=30)
        pool.shutdown(wait=True)


def outcome(scenarios: dict[str, Future], name: str) -> dict[str, Any]:
    return scenarios[name].result(timeout=2 * JOB_TIMEOUT_S + 120)


# ---------------------------------------------------------------------------------------------- tests
def test_rank_killed_the_job_restarts_inside_its_allocation_on_the_node_left(scenarios, record_property) -> None:
    """Issue 33: the project's script keeps the allocation (--no-kill) and its supervisor relaunches the step
    on the node left, from the newest checkpoint: same job, Restarts=0, no queue wait."""
    out = outcome(scenarios, "killed_srun")
    record_property("seconds_to_training_again", round(out["again"], 1))
    job, node = out["job"], out["node"]
    text = job.text()
    # Slurm names the rank that died (task = rank under srun) and stops the rest of the step ...
    assert f"srun: error: {node}: task 1: Killed" in text, job.describe()
    # ... the survivor names the node, and the batch script's supervisor relaunches without it.
    assert "relaunching training inside the allocation on 1 node(s) " in text, job.describe()
    assert out["during"]["JobState"] == "RUNNING" and out["during"]["Restarts"] == "0", out["during"]
    starts = job.rows("start")
    assert [(s["world_size"], s["restart_in_allocation"]) for s in starts] == [(2, 0), (1, 1)], job.describe()
    # from the newest checkpoint: the one before the kill, or one a write in flight then finished
    newest = max(int(re.sub(r"\D", "", name)) for name in out["before"])
    assert starts[1]["resumed"] is True and starts[1]["step"] in (newest, newest + EVERY), job.describe()
    assert badnodes.excluded(job.run_dir) == [node]
    [placed] = re.findall(r"ranks by host \(1 rank, 1 host\): (\S+): 0", text)
    assert placed != node, text
    stop = job.rows()[-1]
    assert stop["kind"] == "stop" and checkpoint.load_latest(job.run_dir)["step"] == stop["step"], job.describe()
    assert job.info["ExitCode"].startswith("75:"), job.describe()
    assert out["again"] <= 60, f"{out['again']:.0f} s from the kill to training again (dist.timeout_s=30)"


def test_rank_killed_without_kill_on_bad_exit_every_survivor_names_it(scenarios, record_property) -> None:
    out = outcome(scenarios, "killed_plain")
    record_property("seconds_to_exit", round(out["took"], 1))
    job, pid = out["job"], out["pid"]
    text = job.text()
    assert job.info["JobState"] == "FAILED", job.describe()
    lines = re.findall(r"^.*ERROR \[rank (\d) (node\d)\] (lost rank .*)$", text, re.M)
    assert {int(r) for r, _, _ in lines} == {0, 1, 3}, job.describe()
    for _, _, line in lines:
        assert re.match(
            rf"lost rank 2 \(host {out['node']}, pid {pid}\): no heartbeat for \d+ s; {helpers.LOST_FOUND}",
            line,
        ), line
    assert "Traceback" not in text, job.describe()
    assert out["took"] <= 30 + 30, f"the survivors took {out['took']:.0f} s to exit (dist.timeout_s=30)"
    assert badnodes.excluded(job.run_dir) == [out["node"]]  # recorded (by each survivor), no requeue (requeue off)


def test_a_lost_node_is_recorded_and_the_requeued_job_resumes_without_it(scenarios) -> None:
    out = outcome(scenarios, "lost_node")
    job, node = out["job"], out["node"]
    assert badnodes.excluded(job.run_dir) == [node], job.describe()
    assert out["excluded"] == node and out["first"]["Restarts"] == "1", (out, job.describe())
    assert f"job {job.job_id} requeued without node(s) {node}" in job.text(), job.describe()
    hosts = expand_hostlist(out["second"]["NodeList"])
    assert node not in hosts and len(hosts) == 2, out["second"]
    resumed = [r for r in job.rows() if r["kind"] == "start"][-1]
    assert resumed["resumed"] and resumed["restart_count"] == 1, job.rows()[-3:]


def test_where_requeue_is_refused_a_successor_job_is_chained_and_resumes(scenarios) -> None:
    out = outcome(scenarios, "chained")
    job, nxt = out["job"], out["next"]
    text = job.text()  # the successor appends to the same log
    assert f"scontrol requeue {job.job_id} failed" in text, job.describe()
    assert out["depends"].startswith(f"afterany:{job.job_id}"), out
    assert out["started"] >= out["ended"], out  # ISO times: the successor started only once this job ended
    starts = [r for r in job.rows() if r["kind"] == "start"]
    stop = next(r for r in job.rows() if r["kind"] == "stop")
    assert starts[1]["resumed"] and starts[1]["step"] == stop["step"] and starts[1]["job_id"] == nxt.job_id, starts


def test_rank_zero_killed_the_survivor_names_it_by_its_lost_store(scenarios, record_property) -> None:
    """Under srun, rank 0 hosts the rendezvous store: when it dies the store dies with it, and that is
    what the survivor reports."""
    out = outcome(scenarios, "killed_store")
    record_property("seconds_to_exit", round(out["took"], 1))
    job = out["job"]
    text = job.text()
    assert job.info["JobState"] == "FAILED", job.describe()
    [line] = re.findall(r"^.*ERROR \[rank 1 node\d\] (lost .*)$", text, re.M)
    assert re.match(
        rf"lost rank 0 \(host {out['node']}, pid {out['pid']}, store at {out['node']}:\d+\): the "
        r"rendezvous store it hosted is unreachable "
        r"\(.+\); this rank's collective failed with: \S",
        line,
    ), line
    assert "Traceback" not in text, job.describe()
    assert out["took"] <= 30 + 30, f"the survivor took {out['took']:.0f} s to exit (dist.timeout_s=30)"
    assert badnodes.excluded(job.run_dir) == [out["node"]]  # rank 0's node, recorded by rank 1


def test_fewer_ranks_than_promised_time_out_naming_expected_and_arrived(scenarios) -> None:
    job = outcome(scenarios, "few_ranks")["job"]
    text = job.text()
    assert job.info["JobState"] == "FAILED", job.describe()
    assert re.search(
        r"ERROR \[rank 0 node\d\] rank 0: rendezvous at node\d:\d+ timed out after 20 s: "
        r"expected 2 ranks, 1 arrived",
        text,
    ), job.describe()
    assert "srun exited 1" in text and "Traceback" not in text, job.describe()
    assert not (job.run_dir / "checkpoints").exists()


def test_requeue_cap_reached_ends_the_job_with_exit_3_not_requeued(scenarios) -> None:
    job = outcome(scenarios, "capped")["job"]
    text = job.text()
    assert job.info["JobState"] == "FAILED" and job.info["Restarts"] == "0", job.describe()
    assert job.info["ExitCode"] == "3:0", job.describe()
    assert re.search(
        r"ERROR \[rank 0 node\d\] requeue cap reached \(0 requeues, slurm.max_requeues=0\): not "
        r"requeueing; checkpoint at step \d+ is on disk",
        text,
    ), job.describe()
    assert "requeued Slurm job" not in text
    stop = [r for r in job.rows() if r["kind"] == "stop"]
    assert len(stop) == 1 and checkpoint.load_latest(job.run_dir)["step"] == stop[0]["step"]
