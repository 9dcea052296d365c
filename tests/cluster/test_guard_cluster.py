"""The guard on the real 4-node test cluster: a skipped step survives a SIGUSR2 and a requeue.

Two jobs of sbatch/mnist_4node.sh side by side (two 4-node jobs of one CPU per rank fit the cluster
at once), 4 ranks on 4 nodes, the poison task of tests/guard_helpers.py selected by a file in the
submit directory (``task=poison_task.py:Poison``) with ``GUARDED`` and ``poison.ids=300``: sample 300
lies in step 9's batch (epoch 1) and in step 18's (epoch 2), and its loss is a spike the guard rolls
back from, replays, sees reproduced and skips; the replay names sample 300, which epoch 2 leaves out of
step 18's batch (no second rollback). Each step sleeps a second, so that a signal lands between steps.

``guard_ref``   left alone: a rollback and a skip at step 9 naming sample 300, the end at step 32.
``guard_usr2``  the same job, ``scancel --signal=USR2`` as soon as its metrics.jsonl has step 9's skip
                line (the run has just gone back to step 5): rank 0 checkpoints at step 6-8 and
                requeues; the relaunch (restart 1) resumes there, goes through step 9 keeping the skip
                (no second rollback for step 9) and through step 18 without sample 300 (kept too: no
                rollback there), and ends bit-identical to ``guard_ref``.

Every run uses one thread per rank (``--cpus-per-task=1``), so reruns are bit-for-bit repeatable.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from cluster.test_sbatch import (
    PER_NODE,
    REPO,
    Driver,
    Job,
    assert_completed,
    assert_same_weights,
    rank_hosts,
    run_plain,
    started,
)
from guard_helpers import GUARDED, write_poison_task

from ddp_slurm.train import checkpoint

pytestmark = pytest.mark.cluster

STEPS = 2 * 512 // 32  # GUARDED: 2 epochs of the task's 512 samples, global batch 32
POISONED = [*GUARDED, "poison.ids=300", "poison.sleep=1.0"]
JOB_TIMEOUT_S = 300.0
SKIPS = [[9, 9]]


class GuardDriver(Driver):
    """Submits from a work directory that holds ``poison_task.py``; the task's own defaults, no ``--config``
    (``task=...`` on the command line, as a user runs a task of their own)."""

    def __init__(self, cluster, workdir: Path) -> None:
        super().__init__(cluster, workdir)
        write_poison_task(workdir)

    def submit(self, job: Job) -> Job:
        job.job_id = self.cluster.sbatch(
            [*job.sbatch_args, str(REPO / "sbatch" / job.script), *job.train_args], cwd=self.workdir
        )
        self.submitted.append(job)
        return job


def guard_job(d: GuardDriver, name: str) -> Job:
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={name}", *POISONED]
    return Job(name, "mnist_4node.sh", ["--nodes=4", *PER_NODE], args, d.workdir, steps=STEPS)


def run_usr2_after_skip(d: GuardDriver, job: Job) -> Job:
    """USR2 to the job once its metrics.jsonl records the skip of step 9 (its first)."""
    d.submit(job)
    d.wait_for(job, "the skip of step 9", lambda: any(r["step"] == 9 for r in job.rows("skip")))
    d.cluster.cancel(job.job_id, "--signal=USR2")
    return d.finish(job, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def guard_jobs(slurm_cluster, tmp_path_factory) -> Iterator[dict[str, Future]]:
    d = GuardDriver(slurm_cluster, tmp_path_factory.mktemp("guard-sbatch"))
    yield from started(
        d,
        {
            "guard_ref": (run_plain, guard_job(d, "guard_ref")),
            "guard_usr2": (run_usr2_after_skip, guard_job(d, "guard_usr2")),
        },
    )


def result(jobs: dict[str, Future], name: str) -> Job:
    return jobs[name].result(timeout=JOB_TIMEOUT_S * 2)


def guard_events(job: Job) -> list[tuple[str, int]]:
    """(kind, step) of the job's rollback, replay and skip lines in metrics.jsonl, in order."""
    return [(r["kind"], r["step"]) for r in job.rows() if r["kind"] in ("rollback", "replay", "skip")]


def guard_file(job: Job) -> list[tuple[str, int]]:
    """(event, step) of the run's own record, ``<run dir>/guard.jsonl``."""
    return [(r["event"], r["step"]) for r in map(json.loads, (job.run_dir / "guard.jsonl").read_text().splitlines())]


def test_usr2_requeue_after_a_skip_keeps_it_and_ends_bit_identical(guard_jobs, slurm_cluster) -> None:
    ref, job = result(guard_jobs, "guard_ref"), result(guard_jobs, "guard_usr2")
    assert_completed(ref, restarts=0)
    assert sorted(rank_hosts(ref).values()) == sorted(slurm_cluster.nodes)  # 4 ranks, one per node
    assert ref.rows("start")[0]["world_size"] == 4
    every_step = [("rollback", 9), ("replay", 9), ("skip", 9)]
    assert guard_events(ref) == every_step, ref.describe()

    assert_completed(job, restarts=1)
    starts, [stop] = job.rows("start"), job.rows("stop")
    assert [s["world_size"] for s in starts] == [4, 4], job.describe()
    assert stop["requeue"] is True, stop  # USR2: rank 0 requeued the job itself
    # Signalled as step 9's skip was recorded, when the run had just gone back to step 5: it stopped before
    # step 9 (each step takes a second, the signal lands within one), so the relaunch went through step 9.
    assert 5 < stop["step"] < 9, f"stopped at step {stop['step']}\n{job.describe()}"
    assert starts[1]["resumed"] is True and starts[1]["restart_count"] == 1, starts
    assert starts[1]["step"] == stop["step"], f"resumed at {starts[1]['step']}, not at {stop['step']}"
    # The relaunch kept the skip: one rollback for step 9 in the whole job, the one of the first run.
    assert [r["step"] for r in job.rows("rollback")] == [9], job.describe()
    assert guard_events(job) == every_step, job.describe()
    assert "restart 0 on 4 node(s)" in job.log_text() and "restart 1 on 4 node(s)" in job.log_text()

    finals = []
    for j in (ref, job):
        assert guard_file(j) == [("rollback", 9), ("skip", 9)], j.name
        finals.append(checkpoint.load_latest(j.run_dir)["guard"])
        assert finals[-1]["skips"] == SKIPS and finals[-1]["rollbacks"] == 1, (j.name, finals[-1])
        assert finals[-1]["samples"] == [[300, 0]], (j.name, finals[-1])
    assert finals[0] == finals[1]  # the loss statistics too: the stop lost no step's loss
    assert_same_weights(job, ref)
