"""Restarting the training step inside the allocation: what to do when a step of the job ends.

The project's batch script keeps its allocation when a node fails (``#SBATCH --no-kill``) and runs its
training step through ``launch/supervise.py``, which asks ``decide`` after every step:

- the step ended the run (0 finished, 75 stopped on a signal, 2 a usage error, 3 the requeue cap): the job
  ends with that code;
- no rank started training (``started`` is False): a launch failure, such as the 1-second credential
  revocation right after a requeue ("Task launch ... failed ... Job credential revoked"). It is retried on
  the same nodes, ``MAX_LAUNCH_RETRIES`` times at most;
- ranks were lost (the survivors recorded their hosts in ``lost_nodes``) or nodes left the job (Slurm shrank
  it): the step is launched again on the job's remaining nodes, from the newest checkpoint, as many nodes as
  the global batch splits over (``node_count``), ``slurm.restarts`` times at most. Past the cap the last
  launch runs without the supervisor's claim, so a loss there requeues the job as before (``chain.py``);
- any other failure (a bug, a NaN): the job ends with it. Relaunching would fail the same way.

Pure: ``Step`` in, ``Plan`` out, tested with plain values and configs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ddp_slurm.config import Config, ConfigError, check_world_size

MAX_LAUNCH_RETRIES = 3
ENDS = {0, 2, 3, 75}  # finished, usage error, requeue cap, stopped on a signal (exitcodes.py)

SUPERVISED = "DDP_SLURM_SUPERVISED"
"""Set (to the batch host's name) in a supervised step: a survivor of a lost rank records it and leaves the
job to the supervisor, unless the batch host itself is lost (its supervisor with it)."""
STEP_RESTART = "DDP_SLURM_STEP_RESTART"
"""Which relaunch inside the allocation this step is (0: the first launch); on the run's start line."""


@dataclass(frozen=True)
class Step:
    """How one training step of the job ended."""

    status: int
    started: bool
    """A rank wrote a new ``start`` line: training began (else the launch itself failed)."""
    nodes: tuple[str, ...]
    """The nodes it ran on."""
    lost: tuple[str, ...] = ()
    """Hosts the survivors recorded in ``lost_nodes`` during the step."""
    live: tuple[str, ...] = ()
    """The job's nodes now (``scontrol show job``: Slurm drops a failed node from a --no-kill job)."""


@dataclass(frozen=True)
class Plan:
    action: str
    """``exit``, ``retry`` (the same nodes) or ``restart`` (on ``nodes``)."""
    code: int = 0
    nodes: tuple[str, ...] = ()
    why: str = ""


def node_count(available: int, fits: Callable[[int], bool]) -> int:
    """The most nodes, at most ``available``, that ``fits`` (0: none)."""
    return next((n for n in range(available, 0, -1) if fits(n)), 0)


def first_nodes(nodes: Sequence[str], fits: Callable[[int], bool]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the nodes the first launch trains on, those that wait): the most of ``nodes`` (spares and slow nodes
    already left out) that ``fits``, the rule every relaunch follows too; ((), nodes) when none fits."""
    n = node_count(len(nodes), fits)
    return tuple(nodes[:n]), tuple(nodes[n:])


def splits_over(cfg: Config, ranks_per_node: int) -> Callable[[int], bool]:
    """``fits`` for ``decide``: whether the global batch splits over that many nodes, by the rule training
    itself refuses a world size with (``config.check_world_size``, ``train.micro_batch_size`` included)."""

    def fits(nodes: int) -> bool:
        try:
            check_world_size(cfg, nodes * ranks_per_node)
        except ConfigError:
            return False
        return True

    return fits


def decide(
    step: Step,
    *,
    restarts: int,
    retries: int,
    cap: int,
    avoid: Sequence[str],
    fits: Callable[[int], bool],
    global_batch: int,
) -> Plan:
    """What follows ``step``: ``restarts`` and ``retries`` made so far, ``cap`` (``slurm.restarts``),
    ``avoid``: every host lost in this job so far, ``fits``: whether the global batch (``global_batch``, for
    the message) splits over that many nodes (``splits_over``)."""
    if step.status in ENDS:
        return Plan("exit", step.status)
    if not step.started:
        if retries < MAX_LAUNCH_RETRIES:
            return Plan("retry", nodes=step.nodes, why=f"the launch failed (exit {step.status}) before training began")
        return Plan("exit", step.status, why=f"the launch failed {retries + 1} times")
    gone = sorted(set(step.lost) | (set(step.nodes) - set(step.live) if step.live else set()))
    if not gone:
        return Plan("exit", step.status, why="training failed, and no node was lost")
    if restarts >= cap:
        return Plan("exit", step.status, why=f"slurm.restarts={cap} used up")
    left = [n for n in step.live or step.nodes if n not in set(avoid) | set(gone)]
    n = node_count(len(left), fits)
    if n == 0:
        return Plan(
            "exit",
            step.status,
            why=f"lost {','.join(gone)}; train.global_batch_size={global_batch} splits over none of the {len(left)} node(s) left",
        )
    return Plan("restart", nodes=tuple(left[:n]), why=f"lost {','.join(gone)}")


def launch_label(restart: int | str, relaunch: int) -> str:
    """How ``lost_nodes`` names one launch of a job: its requeue count, ``R.N`` for the Nth relaunch inside the
    allocation."""
    return f"{restart}.{relaunch}" if relaunch else str(restart)


def step_restart(environ: Mapping[str, str]) -> int:
    """This step's relaunch number inside the allocation (0 outside a supervised step)."""
    value = environ.get(STEP_RESTART, "0")
    return int(value) if value.isdigit() else 0
