"""What follows a training step of the project's batch script (ddp_slurm/slurmjob/restarts.py), with plain
values: a relaunch inside the allocation on the nodes left, a launch retried, or the job's end; and what the
supervisor (ddp_slurm/launch/supervise.py) gives each launch: a fresh port, its own trace files, an srun that
does not wait for a vanished node."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import base_env

from ddp_slurm import config
from ddp_slurm.distributed.flightrec import launch_prefix
from ddp_slurm.exitcodes import EXIT_FAILURE
from ddp_slurm.launch.supervise import _command, _leaving_since, _lost_since, _run_step, fresh_port
from ddp_slurm.slurmjob.restarts import (
    MAX_LAUNCH_RETRIES,
    Step,
    decide,
    first_nodes,
    launch_label,
    node_count,
    splits_over,
    step_restart,
)

FOUR = ("node1", "node2", "node3", "node4")


def splits(batch: int, accumulate: int = 1, ranks_per_node: int = 1):
    """``fits`` from a config with this global batch and accumulation (the supervisor's own rule)."""
    cfg = config.load(None, [f"train.global_batch_size={batch}", f"train.accumulate={accumulate}"])
    return splits_over(cfg, ranks_per_node)


def plan(step: Step, restarts: int = 0, retries: int = 0, cap: int = 3, avoid=(), batch: int = 48, accumulate=1):
    return decide(
        step,
        restarts=restarts,
        retries=retries,
        cap=cap,
        avoid=list(avoid),
        fits=splits(batch, accumulate),
        global_batch=batch,
    )


def test_a_run_that_ended_ends_the_job_with_its_code() -> None:
    for code in (0, 75, 2, 3):
        assert (plan(Step(code, True, FOUR)).action, plan(Step(code, True, FOUR)).code) == ("exit", code)


def test_a_lost_node_relaunches_on_the_nodes_left_as_many_as_the_batch_splits_over() -> None:
    lost = Step(1, True, FOUR, lost=("node2",), live=FOUR)
    p = plan(lost)
    assert (p.action, p.nodes) == ("restart", ("node1", "node3", "node4")) and "node2" in p.why
    # Slurm dropped node3 from the job (--no-kill), nobody recorded it: gone all the same
    p = plan(Step(1, True, FOUR, live=("node1", "node2", "node4")))
    assert (p.action, p.nodes) == ("restart", ("node1", "node2", "node4"))
    # 64 does not split over 3 nodes: 2 of them
    assert plan(lost, batch=64).nodes == ("node1", "node3")
    # a node lost before stays out
    assert plan(lost, avoid=["node4"]).nodes == ("node1", "node3")


def test_past_the_cap_or_without_a_lost_node_the_job_ends_with_the_failure() -> None:
    lost = Step(1, True, FOUR, lost=("node2",), live=FOUR)
    p = plan(lost, restarts=3)
    assert (p.action, p.code) == ("exit", 1) and "slurm.restarts=3 used up" in p.why
    p = plan(Step(1, True, FOUR, live=FOUR))  # a bug or a NaN: relaunching would fail the same way
    assert (p.action, p.code) == ("exit", 1) and "no node was lost" in p.why
    p = plan(Step(1, True, ("node1", "node2"), lost=("node2",), live=("node1", "node2")), batch=3, accumulate=2)
    assert p.action == "exit" and "splits over none" in p.why


def test_a_launch_that_failed_before_training_is_retried_a_few_times() -> None:
    failed = Step(1, False, FOUR, live=FOUR)
    p = plan(failed)
    assert (p.action, p.nodes) == ("retry", FOUR)
    p = plan(failed, retries=MAX_LAUNCH_RETRIES)
    assert (p.action, p.code) == ("exit", 1)


def test_node_count_and_the_step_restart_variable() -> None:
    assert [node_count(n, splits(48)) for n in (4, 3, 2, 1, 0)] == [4, 3, 2, 1, 0]
    assert node_count(3, splits(64, 1, 4)) == 2 and node_count(4, splits(7)) == 1
    assert node_count(4, splits(6, 2, 2)) == 0
    micro = config.load(None, ["train.global_batch_size=48", "train.micro_batch_size=4"])
    assert node_count(4, splits_over(micro, 1)) == 4 and node_count(4, splits_over(micro, 5)) == 0
    assert step_restart({}) == 0 and step_restart({"DDP_SLURM_STEP_RESTART": "2"}) == 2
    assert step_restart({"DDP_SLURM_STEP_RESTART": "x"}) == 0


def test_under_torchrun_each_launch_has_its_own_rendezvous_on_its_first_node() -> None:
    train = ["/venv/bin/python", "-m", "ddp_slurm.train", "--config", "job.yaml", "train.epochs=2"]
    assert _command(train, ("node1", "node2"), 0, 20042, "42.0") == train  # one srun task per rank: as given
    assert _command(train, ("node3", "node4"), 4, 20043, "42.1") == [
        "/venv/bin/python",
        "-m",
        "ddp_slurm.launch",
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node3:20043",
        "--rdzv-id=42.1",
        "-m",
        "ddp_slurm.train",
        "--config",
        "job.yaml",
        "train.epochs=2",
    ]


def test_each_launch_gets_a_fresh_rendezvous_port_and_its_own_trace_files() -> None:
    """A rank of the last launch that cannot be killed (in the kernel on a hung device) may hold the old port; a
    relaunch must not overwrite the first launch's flight-recorder files either."""
    assert [fresh_port(20000 + 11998, n) for n in range(4)] == [31998, 31999, 20000, 20001]  # derive_port's range
    assert [fresh_port(29500, n) for n in range(3)] == [29500, 29501, 29502]
    assert fresh_port(65535, 2) == 65533
    assert launch_prefix("/sub/nccl-traces/42.0-rank", 0) == "/sub/nccl-traces/42.0-rank"
    assert launch_prefix("/sub/nccl-traces/42.0-rank", 2) == "/sub/nccl-traces/42.0.2-rank"
    assert launch_prefix("/tmp/nccl_trace_rank_", 1) == "/tmp/nccl_trace_rank_.1-"
    assert launch_label(0, 0) == "0" and launch_label(1, 2) == "1.2"


def lost_file(tmp_path: Path, *lines: tuple[str, ...]) -> Path:
    path = tmp_path / "lost_nodes"
    path.write_text("".join("\t".join(line) + "\n" for line in lines))
    return path


def test_a_late_verdict_of_the_last_launch_or_a_guard_record_is_not_this_launch_leaving(tmp_path: Path) -> None:
    verdict = "lost rank 2 (host node3, pid 9): no heartbeat for 8 s"
    path = lost_file(
        tmp_path,
        ("node3", "42", "0", "T", "0", verdict),  # launch 0's survivors, late
        ("node2", "42", "0", "T", "1", "guard: step 9 not reproduced by a replay; rank(s) [1] computed differently"),
        ("node4", "42", "0.1", "T", "0", verdict.replace("node3", "node4")),
        ("node1", "7", "0.1", "T", "0", verdict.replace("node3", "node1")),  # another job sharing the run
    )
    assert _leaving_since(path, 0, "42", "0.1") == ("node4",)
    assert _leaving_since(path, 0, "42", "0") == ("node3",)
    assert _lost_since(path, 0, "42", "0.1") == ("node2", "node4")  # the guard's record counts, the late one not
    assert _lost_since(path, 3, "42", "0.1") == ()


def test_an_srun_left_waiting_for_a_vanished_node_is_ended_once_the_survivors_recorded_it(tmp_path: Path) -> None:
    """srun waits for a silent node's tasks until Slurm's node timeout; the supervisor ends it STEP_GRACE_S after
    this launch's survivors recorded the loss. Stand-ins for srun: one that would wait 60 s, one that ends."""
    path = lost_file(tmp_path, ("node1", "42", "0", "T", "0", "lost rank 1 (host node1, pid 9): no heartbeat"))
    # a line of another launch ends nothing: the step's own status
    assert _run_step(["sh", "-c", "sleep 1; exit 5"], dict(os.environ), path, 0, "42", "0.1") == 5

    def survivors_record() -> None:
        time.sleep(1)
        with path.open("a") as f:
            f.write("node3\t42\t0.1\tT\t0\tlost rank 2 (host node3, pid 9): no heartbeat for 8 s\n")

    writer = threading.Thread(target=survivors_record)
    start = time.monotonic()
    writer.start()
    status = _run_step(["sleep", "60"], dict(os.environ), path, 1, "42", "0.1")
    took = time.monotonic() - start
    writer.join()
    assert status == EXIT_FAILURE and took < 30, (status, took)  # ended, not waited for


@pytest.mark.parametrize(
    ("argv", "environ", "says"),
    [
        ([], {}, "runs inside a Slurm job only"),
        ([], {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS_PER_NODE": "x"}, "tasks-per-node"),
        ([], {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[0-9999][0-9999]"}, "n[0-9999][0-9999]"),
        (["--torchrun", "-1"], {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}, "argument --torchrun"),
    ],
)
def test_the_supervisor_refuses_what_is_no_job_of_slurm_s_in_one_line(argv, environ, says) -> None:
    """Outside a job it was ``KeyError: 'SLURM_JOB_ID'``; a forged ``SLURM_NTASKS_PER_NODE`` or a node list past the
    cap a traceback; ``--torchrun -1`` an AssertionError in every task, retried 3 times."""
    env = base_env(**environ)
    cmd = [sys.executable, "-m", "ddp_slurm.launch.supervise", *argv, "--", sys.executable, "-m", "ddp_slurm.train"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert says in res.stderr, res.stderr


def test_one_rule_for_the_node_counts_that_train_spares_and_slow_nodes_included() -> None:
    """4 nodes with ``slurm.spare_nodes=1`` (or one slow node left out) leave 3, over which a global batch of 64
    does not split: the job once ended without training. ``submit`` now refuses it before the queue, and the
    supervisor's first launch trains on the most nodes that split, as every relaunch does."""
    cfg = config.load(None, ["slurm.nodes=4", "slurm.spare_nodes=1"])
    with pytest.raises(config.ConfigError, match=r"\(3 of 4 node\(s\) train, 1 spare, x 1 task\(s\)\)"):
        config.check_node_range(cfg, 1)
    config.check_node_range(config.with_overrides(cfg, ["slurm.nodes=5"]), 1)  # 4 train, 1 waits
    with pytest.raises(config.ConfigError, match="slurm.spare_nodes=2 leaves none of 2 node"):
        config.check_node_range(config.with_overrides(cfg, ["slurm.nodes=2", "slurm.spare_nodes=2"]), 1)
    fits = splits_over(cfg, 1)
    assert first_nodes(("n1", "n2", "n3"), fits) == (("n1", "n2"), ("n3",))  # a slow node out of 4: 2 train
    assert first_nodes(("n1", "n2", "n3", "n4"), fits) == (("n1", "n2", "n3", "n4"), ())
    odd = config.load(None, ["train.global_batch_size=63"])
    assert first_nodes(("n1", "n2"), splits_over(odd, 2)) == ((), ("n1", "n2"))
