"""Tasks the package does not know, on the real 4-node test cluster: the project's sbatch scripts and
``python -m ddp_slurm.submit --nodes 4``, with the task selected by a file path relative to the
submit directory (``task=examples/addition/task.py:Addition``, ``task=line_task.py:Line``), as a user
submits their own code.

``add_ref``      sbatch/mnist_4node.sh --config add.yaml: the addition example (dropout, augmentation
                 in ``dataset[i]``, 2 DataLoader workers per rank), 4 ranks on 4 nodes, to the end.
``add_usr2``     the same job, ``scancel --signal=USR2`` mid-epoch: rank 0 checkpoints and requeues, the
                 job resumes and ends bit-identical to ``add_ref``.
``line_torchrun`` sbatch/mnist_torchrun.sh: the minimal task of tests/tasks_helpers.py (nothing in the
                 package names it), 4 agents x 1 worker.
``eval_ref``     sbatch/mnist_4node.sh: that task made slow (tests/tasks_helpers.SLOW_LINE_TASK), an
                 evaluation every 4 steps whose batches sleep, to the end.
``eval_usr2``    the same job, ``scancel --signal=USR2`` while an evaluation runs: abandoned within a
                 batch, the step checkpointed, requeued; the resumed job redoes that evaluation and ends
                 with ``eval_ref``'s evaluation lines and weights.
``eval_early``   the slow task without sleeps, 20 epochs, ``eval.patience=3``: early stopping ends the job
                 COMPLETED (exit 0), never requeued.
Then submit: the minimal task and the example on 4 nodes, ``--wait``.

Jobs use one CPU per rank (``--cpus-per-task=1``) so that runs are bit-for-bit repeatable.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cluster.test_sbatch import (
    PER_NODE,
    REPO,
    Driver,
    Job,
    assert_completed,
    assert_resumed_exactly,
    assert_same_weights,
    rank_hosts,
    run_plain,
    run_scancel_usr2,
    started,
)
from tasks_helpers import LINE_RUN, SLOW_LINE_RUN, addition_tiny, write_line_task, write_slow_line_task

from ddp_slurm.train import checkpoint

pytestmark = pytest.mark.cluster

ADD_STEPS_PER_EPOCH = 2048 // 64
ADD_EPOCHS = 2  # long enough that a USR2 sent once training is underway lands mid-run
RELATIVE_TASK = "task=examples/addition/task.py:Addition"
JOB_TIMEOUT_S = 420.0


def task_yaml(overrides: list[str]) -> str:
    """``KEY=VALUE`` overrides as a job YAML file (the way a user gives the sbatch scripts their task)."""
    sections: dict[str, dict[str, str]] = {}
    lines = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "task":
            lines.append(f"task: {value}")
            continue
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    for section, body in sections.items():
        lines.append(f"{section}:")
        lines += [f"  {name}: {value}" for name, value in body.items()]
    return "\n".join(lines) + "\n"


class TaskDriver(Driver):
    """Submits from a work directory that holds the user's code: ``examples/`` (a link to the
    project's) and ``line_task.py``; each job's config is a YAML file there."""

    def __init__(self, cluster, workdir: Path) -> None:
        super().__init__(cluster, workdir)
        (workdir / "examples").symlink_to(REPO / "examples")
        write_line_task(workdir)
        write_slow_line_task(workdir)

    def submit(self, job: Job) -> Job:
        config_file = self.workdir / f"{job.name}.yaml"
        config_file.write_text(task_yaml([a for a in job.train_args if a.startswith(("task=", "data.", "model."))]))
        rest = [a for a in job.train_args if not a.startswith(("task=", "data.", "model."))]
        job.job_id = self.cluster.sbatch(
            [*job.sbatch_args, str(REPO / "sbatch" / job.script), "--config", config_file.name, *rest],
            cwd=self.workdir,
        )
        self.submitted.append(job)
        return job


def addition_job(d: TaskDriver, name: str, script: str = "mnist_4node.sh") -> Job:
    args = [
        f"run.output_root={d.workdir / 'runs'}",
        f"run.name={name}",
        *[RELATIVE_TASK if a.startswith("task=") else a for a in addition_tiny(epochs=ADD_EPOCHS)],
    ]
    return Job(name, script, ["--nodes=4", *PER_NODE], args, d.workdir, steps=ADD_EPOCHS * ADD_STEPS_PER_EPOCH)


@pytest.fixture(scope="module")
def driver(slurm_cluster, tmp_path_factory) -> TaskDriver:
    return TaskDriver(slurm_cluster, tmp_path_factory.mktemp("tasks-sbatch"))


@pytest.fixture(scope="module")
def addition_jobs(driver: TaskDriver) -> Iterator[dict[str, Future]]:
    """The example left alone and the same job interrupted by USR2, side by side (two 4-node jobs fit)."""
    yield from started(
        driver,
        {
            "add_ref": (run_plain, addition_job(driver, "add_ref")),
            "add_usr2": (run_scancel_usr2, addition_job(driver, "add_usr2")),
        },
    )


@pytest.fixture(scope="module")
def line_job(driver: TaskDriver) -> Iterator[dict[str, Future]]:
    d = driver
    line = Job(
        "line_torchrun",
        "mnist_torchrun.sh",
        ["--nodes=4", *PER_NODE],
        [f"run.output_root={d.workdir / 'runs'}", "run.name=line_torchrun", "task=line_task.py:Line", *LINE_RUN],
        d.workdir,
        steps=24,
    )
    yield from started(d, {"line_torchrun": (run_plain, line)})


# The slow Line task for 3 epochs (24 steps, 6 evaluations), each evaluation batch sleeping 1 s, so that
# most of the job's time is spent evaluating.
SLOW_EVAL = [*SLOW_LINE_RUN, "train.epochs=3", "slow.eval_sleep_s=1.0"]


def eval_job(d: TaskDriver, name: str) -> Job:
    args = [f"run.output_root={d.workdir / 'runs'}", f"run.name={name}", *SLOW_EVAL]
    args.append(f"slow.eval_log={d.workdir / f'{name}-evals.log'}")
    return Job(name, "mnist_4node.sh", ["--nodes=4", *PER_NODE], args, d.workdir, steps=24)


def early_job(d: TaskDriver) -> Job:
    job = eval_job(d, "eval_early")
    job.train_args = [a for a in job.train_args if not a.startswith(("slow.", "train.epochs="))]
    job.train_args += ["train.epochs=20", "eval.patience=3", "eval.min_delta=1e-5"]
    job.steps = 20 * 8
    return job


def eval_batches(job: Job) -> list[float]:
    """When each evaluation batch of the job began (any rank), from the slow task's log."""
    path = job.workdir / f"{job.name}-evals.log"
    return [float(line.split()[0]) for line in path.read_text().splitlines()] if path.exists() else []


def run_usr2_during_evaluation(d: TaskDriver, job: Job) -> Job:
    """USR2 to the job once its second evaluation is under way (step 8, an epoch's end)."""
    d.submit(job)
    d.wait_for(job, "the second evaluation", lambda: len(eval_batches(job)) >= 3 * 4 + 2)
    job.info["sent"] = str(time.time())
    d.cluster.cancel(job.job_id, "--signal=USR2")
    sent = job.info.pop("sent")
    job = d.finish(job)
    job.info["sent"] = sent
    return job


@pytest.fixture(scope="module")
def eval_jobs(driver: TaskDriver) -> Iterator[dict[str, Future]]:
    yield from started(
        driver,
        {
            "eval_ref": (run_plain, eval_job(driver, "eval_ref")),
            "eval_usr2": (run_usr2_during_evaluation, eval_job(driver, "eval_usr2")),
            "eval_early": (run_plain, early_job(driver)),
        },
    )


def result(jobs: dict[str, Future], name: str) -> Job:
    return jobs[name].result(timeout=JOB_TIMEOUT_S * 2)


def test_sbatch_example_4_nodes_to_the_end(addition_jobs, slurm_cluster) -> None:
    job = result(addition_jobs, "add_ref")
    assert_completed(job, restarts=0)
    assert sorted(rank_hosts(job).values()) == sorted(slurm_cluster.nodes)
    start = job.rows("start")[0]
    # The task file as the user named it (relative to the submit directory), recorded absolute.
    assert (start["world_size"], start["task"]) == (4, f"{job.workdir}/examples/addition/task.py:Addition")
    final = job.rows("eval")[-1]
    assert final["test_samples"] == 256 and 0 <= final["accuracy"] <= 1, final
    assert len(checkpoint.load_latest(job.run_dir)["rng"]) == 4  # every rank's RNG streams


def test_sbatch_example_usr2_mid_epoch_requeues_and_ends_bit_identical(addition_jobs) -> None:
    job, ref = result(addition_jobs, "add_usr2"), result(addition_jobs, "add_ref")
    assert_completed(job, restarts=1)
    [stop] = assert_resumed_exactly(job)
    assert stop["requeue"] is True and stop["step"] % ADD_STEPS_PER_EPOCH != 0, stop  # mid-epoch
    assert_same_weights(job, ref)


def test_sbatch_torchrun_minimal_task(line_job, slurm_cluster) -> None:
    job = result(line_job, "line_torchrun")
    assert_completed(job, restarts=0)
    start = job.rows("start")[0]
    assert (start["world_size"], start["launcher"], start["task"]) == (
        4,
        "torchrun",
        f"{job.workdir}/line_task.py:Line",
    )
    assert job.rows("eval")[-1]["mse"] < 0.1
    state = checkpoint.load_latest(job.run_dir)
    assert abs(state["model"]["weight"].item() - 3) < 0.3 and abs(state["model"]["bias"].item() - 1) < 0.3


def test_usr2_during_a_long_evaluation_abandons_it_requeues_and_redoes_it(eval_jobs) -> None:
    job, ref = result(eval_jobs, "eval_usr2"), result(eval_jobs, "eval_ref")
    assert_completed(job, restarts=1)
    [stop] = assert_resumed_exactly(job)
    assert stop["requeue"] is True and stop["step"] == 8, stop  # the evaluation at step 8 was under way
    first_run = job.rows()[: job.rows().index(stop)]
    assert 8 not in [r["step"] for r in first_run if r["kind"] == "eval"], first_run
    assert "evaluation abandoned on a stop signal" in job.log_text(), job.describe()
    # Each rank may have begun one more batch (1 s each) before it saw the signal; none began a second one.
    # The requeued run cannot evaluate within 3 s of the signal (the job ends, restarts, imports torch).
    sent = float(job.info["sent"])
    late = [t for t in eval_batches(job) if sent < t < sent + 3.0]
    assert len(late) <= 4, f"evaluation batches begun after the signal: {late}"

    def evals(j: Job) -> list[tuple]:
        seen: dict[int, tuple] = {}
        for r in j.rows("eval"):
            seen[r["step"]] = (r["step"], r["mse"], r["test_samples"])
        return list(seen.values())

    assert evals(job) == evals(ref) and [e[0] for e in evals(ref)] == [4, 8, 12, 16, 20, 24]
    assert_same_weights(job, ref)


def test_early_stopping_ends_the_job_completed_without_a_requeue(eval_jobs) -> None:
    job = result(eval_jobs, "eval_early")
    assert (job.info["JobState"], job.info["ExitCode"], job.info["Restarts"]) == ("COMPLETED", "0:0", "0"), (
        job.describe()
    )
    [early] = job.rows("early_stop")
    assert early["step"] < job.steps and early["best_step"] < early["step"], early
    assert job.rows()[-1]["kind"] == "end" and job.rows()[-1]["step"] == early["step"], job.describe()
    assert "early stop at step" in job.log_text() and "requeue" not in job.log_text().lower(), job.describe()
    assert checkpoint.load_latest(job.run_dir)["finished"]


# --------------------------------------------------------------------------- submit
def submit(cluster, cwd: Path, *args: str, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_slurm.submit", "--nodes", "4", "--tasks-per-node", "1", "--cpus-per-task", "1"]
        + ["--wait", *args],
        cwd=cwd,
        env={**cluster.env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        text=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
    )


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_submit_4_nodes_minimal_task_and_example(slurm_cluster, tmp_path) -> None:
    """``python -m ddp_slurm.submit --nodes 4 task=<file>.py:<Name>`` from the user's directory: both
    tasks train on 4 ranks to the end (submitted together, followed with --wait)."""
    write_line_task(tmp_path)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    example = [RELATIVE_TASK if a.startswith("task=") else a for a in addition_tiny(epochs=1)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        line = pool.submit(submit, slurm_cluster, tmp_path, "--name", "line", "task=line_task.py:Line", *LINE_RUN)
        time.sleep(0.5)
        add = pool.submit(submit, slurm_cluster, tmp_path, "--name", "add", *example)
        results = {"line": line.result(), "add": add.result()}
    for name, res in results.items():
        assert res.returncode == 0, f"{name}: {res.stdout[-3000:]}{res.stderr[-2000:]}"
        rows = metrics_rows(tmp_path / "runs" / name)
        assert (rows[0]["world_size"], rows[0]["launcher"]) == (4, "slurm"), rows[0]
        assert rows[-1]["kind"] == "end", rows[-1]
    assert metrics_rows(tmp_path / "runs" / "line")[-1]["best_mse"] < 0.1
    assert metrics_rows(tmp_path / "runs" / "add")[-1]["step"] == ADD_STEPS_PER_EPOCH
    state = checkpoint.load_latest(tmp_path / "runs" / "add")
    assert (
        state["finished"] and len(state["rng"]) == 4 and all(torch.isfinite(t).all() for t in state["model"].values())
    )
