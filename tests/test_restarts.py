"""What follows a training step of the project's batch script (ddp_slurm/slurmjob/restarts.py), with plain
values: a relaunch inside the allocation on the nodes left, a launch retried, or the job's end."""

from __future__ import annotations

from ddp_slurm import config
from ddp_slurm.launch.supervise import _command
from ddp_slurm.slurmjob.restarts import MAX_LAUNCH_RETRIES, Step, decide, node_count, splits_over, step_restart

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
