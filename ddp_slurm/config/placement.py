"""The sections about where a run runs and how it is logged: ``dist``, ``slurm`` and ``log``. Every key of
them may change between the launches of one run (``RESUMABLE``): how a run is placed or logged, not what it
computes. Declared with ``checked`` (``sections.py``); ``schema.py`` puts the sections together, and
``launch/flags.py`` makes ``submit``'s resource flags from ``slurm``'s fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from ddp_slurm import slurm_time
from ddp_slurm.config.sections import checked

# Slurm partition/account/QOS names: no whitespace or shell-special characters.
SLURM_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._,:-]{0,199}")


def _slurm_word(v: str | None) -> bool:
    return v is None or bool(SLURM_WORD.fullmatch(v))


def _slurm_time(v: str) -> bool:
    """True, or ValueError saying what is wrong (``'0' is no time at all``): a flag's message says why."""
    slurm_time.minutes(v)
    return True


def _size(v: str) -> bool:
    """A memory size as sbatch's ``--mem`` takes it: ``64G``, ``512M``, ``1T``."""
    return bool(re.fullmatch(r"\d+[KMGT]?B?", v, re.I))


@dataclass
class DistConfig:
    RESUMABLE: ClassVar[bool] = True  # how a run is saved, placed or logged, not what it computes

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """``auto``: nccl with CUDA, gloo without."""
    timeout_s: float = checked(300.0, check=lambda v: 0 < v <= 1e7, expected="a number > 0 and <= 10000000 (seconds)")
    """Seconds a rendezvous or collective may wait for missing ranks before failing with a message."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """``ddp``: every rank holds the whole model, gradients and optimizer state. ``fsdp``: FSDP2 shards the
    three over the ranks (the task's ``shard_units``), and checkpoints become directories of shards. A run
    keeps the strategy it started with (docs/scaling.md)."""


@dataclass
class SlurmConfig:
    RESUMABLE: ClassVar[bool] = True  # how a run is saved, placed or logged, not what it computes

    nodes: int = checked(1, check=lambda v: v >= 1, expected="an integer >= 1", flags=("-N", "--nodes"))
    """Nodes ``submit`` asks for; ``MIN-MAX`` (``--nodes 2-4``, ``slurm.nodes=2-4``) is a range: this is MAX and
    ``slurm.min_nodes`` MIN."""
    min_nodes: int | None = checked(
        None, check=lambda v: v is None or v >= 1, expected="null or an integer >= 1", flags=()
    )
    """With ``nodes``, a range (sbatch's ``--nodes=MIN-MAX``): Slurm starts the job on as few as this many nodes
    when ``nodes`` are not free. Every count in the range must keep the global batch with the same per-rank
    micro-batch (``train.micro_batch_size``), or ``submit`` refuses it before the job queues (null: exactly
    ``nodes``)."""
    gpus_per_node: int = checked(0, check=lambda v: v >= 0, expected="an integer >= 0")
    """GPUs per node ``submit`` asks for (0: a CPU job)."""
    tasks_per_node: int | None = checked(
        None,
        check=lambda v: v is None or v >= 1,
        expected="null or an integer >= 1",
        flags=("--tasks-per-node", "--ntasks-per-node"),  # sbatch's spelling too
    )
    """Ranks per node (null: one per GPU, 1 without GPUs)."""
    cpus_per_task: int = checked(2, check=lambda v: v >= 1, expected="an integer >= 1")
    """CPU cores per rank; torch uses this many threads."""
    partition: str | None = checked(
        None, check=_slurm_word, expected="null or a Slurm name (letters, digits, . _ , : -)"
    )
    """Partition (null: the cluster's default)."""
    account: str | None = checked(None, check=_slurm_word, expected="null or a Slurm name (letters, digits, . _ , : -)")
    """Account to charge (null: your default)."""
    qos: str | None = checked(None, check=_slurm_word, expected="null or a Slurm name (letters, digits, . _ , : -)")
    """Quality of service (null: the default)."""
    constraint: str | None = checked(
        None,
        check=lambda v: v is None or (bool(v) and not re.search(r"[^A-Za-z0-9_.,:|&!*()\[\]-]", v)),
        expected="null or a Slurm constraint (letters, digits and . _ , : | & ! * ( ) [ ] -)",
    )
    """Node feature constraint (null: none)."""
    time: str = checked("01:00:00", check=_slurm_time, expected=f"a Slurm time ({slurm_time.FORMATS})")
    """Time limit in Slurm's syntax: ``MM``, ``HH:MM:SS``, ``D-HH:MM``, ... (``time_min=N`` still means N minutes)."""
    mem: str | None = checked(None, check=lambda v: v is None or _size(v), expected="null or a size like 64G")
    """Memory per node, as sbatch's ``--mem`` (``64G``; null: the cluster's default)."""
    mem_per_gpu: str | None = checked(None, check=lambda v: v is None or _size(v), expected="null or a size like 16G")
    """Memory per GPU, as sbatch's ``--mem-per-gpu`` (null: not asked for)."""
    exclusive: bool = False
    """Ask for whole nodes (sbatch's ``--exclusive``): no other job shares them."""
    signal: Literal["USR1", "USR2", "TERM", "INT", "HUP", "URG"] = "USR2"
    """Signal that means "checkpoint, requeue and stop" (Slurm's ``--signal``); SIGTERM always stops too."""
    signal_delay_s: int = checked(
        120,
        check=lambda v: 0 <= v <= 10**7,
        expected="an integer from 0 to 10000000 (seconds)",
        flags=("--signal-delay",),
    )
    """Seconds before the time limit at which Slurm sends ``signal``."""
    requeue: bool = checked(True, flags=())  # on by default: a flag could not turn it off
    """On ``signal`` inside a Slurm job, rank 0 requeues the job after the checkpoint is on disk."""
    requeue_mode: Literal["auto", "requeue", "chain"] = checked("auto", flags=())  # submit jobs never chain
    """How a stopped job continues: ``requeue`` (``scontrol requeue``), ``chain`` (a successor job with
    ``--dependency=afterany`` on this one, for sites that forbid requeueing), ``auto`` (requeue, and chain
    when Slurm refuses it). sbatch-script jobs only chain; ``submit`` jobs are resubmitted by hand."""
    spare_nodes: int = checked(0, check=lambda v: v >= 0, expected="an integer >= 0", flags=())
    """Nodes of the project's sbatch script's allocation kept out of training until one is lost (ask sbatch for
    that many more): a relaunch after a lost node then runs on as many nodes as before."""
    slow_factor: float = checked(2.0, check=lambda v: v > 1, expected="a number > 1", flags=())
    """A rank whose compute time per step (its forward) exceeds this many times the other ranks' median, log
    window after log window, is named slow with its host (``<run dir>/slow_nodes``)."""
    slow_windows: int = checked(5, check=lambda v: v >= 1, expected="an integer >= 1", flags=())
    """Log windows in a row (``train.log_every_steps`` steps each) a rank must be slow before it is named."""
    exclude_slow: bool = checked(False, flags=())
    """Leave the nodes named slow out of the next requeue, relaunch inside the allocation and submit, like lost
    nodes (off: named only)."""
    restarts: int = checked(3, check=lambda v: v >= 0, expected="an integer >= 0", flags=())
    """Relaunches of the training step inside the allocation after a lost node (the project's sbatch script:
    ``--no-kill`` keeps the allocation, the step runs again on the nodes left, same job, no queue wait); past
    them a lost node requeues the job as before (0: always requeue). docs/faults.md."""
    max_requeues: int = checked(20, check=lambda v: v >= 0, expected="an integer >= 0")
    """Cap on requeues (``SLURM_RESTART_COUNT``); beyond it the job stops with a message instead of looping."""

    @property
    def node_span(self) -> tuple[int, int]:
        """(fewest, most) nodes the job may run on."""
        return (self.min_nodes or self.nodes, self.nodes)

    @property
    def nodes_text(self) -> str:
        """``4`` or ``2-4``, as sbatch's ``--nodes`` says it."""
        lo, hi = self.node_span
        return f"{lo}-{hi}" if lo != hi else str(hi)


@dataclass
class LogConfig:
    RESUMABLE: ClassVar[bool] = True  # how a run is saved, placed or logged, not what it computes

    tensorboard: bool = False
    """Also write TensorBoard event files to ``<run dir>/tensorboard`` (needs ``pip install ddp_slurm[tensorboard]``)."""
    mlflow: bool | str = checked(False, check=lambda v: v != "", expected="true, false or a tracking URI")
    """Also log to MLflow: ``true`` (a file store in ``<run dir>/mlruns``) or a tracking URI (docs/loggers.md)."""
    wandb: bool | str = checked(False, check=lambda v: v != "", expected="true, false or a project name")
    """Also log to Weights & Biases: ``true`` (project ``ddp_slurm``) or a project name; ``WANDB_MODE=offline`` works."""
    csv: bool = False
    """Also write ``<run dir>/csv/train.csv``, ``eval.csv`` and ``events.csv``."""
