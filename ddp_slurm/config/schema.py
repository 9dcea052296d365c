"""The config's schema: every section as a dataclass, and each key declared once, on its field.

A field carries its type, its default, its docstring (the printed reference, ``doc.py``) and, through
``checked``, its value check, whether it may change between the launches of one run, its YAML key and
(``slurm`` only) its ``submit`` flags. A section whose every key may change says so once (``RESUMABLE``).
Other modules of the package read these declarations: ``loading`` (files, overrides, checks),
``relaunch`` (what a relaunch may change), ``launch/flags.py`` (``submit``'s resource flags).

A config's task sections are checked only once its task is imported (``Config.resolved``): reading a
run (``report``, a dry run, resume's checks, a checkpoint's embedded config) keeps them as given
(``Unchecked``), because importing runs the Python file the config names, which a co-tenant may have
written together with the config.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from ddp_slurm import errors, skips, slurm_time, taskref
from ddp_slurm.config.unchecked import Unchecked
from ddp_slurm.runpaths import RunPaths


class ConfigError(errors.UsageError, ValueError):
    """A config file, override or value that cannot be used (exit 2). The message is one line."""


# A run name becomes a directory, a Slurm job name and part of the job script: a safe character set.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=,-]{0,199}")
# Slurm partition/account/QOS names: no whitespace or shell-special characters.
SLURM_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._,:-]{0,199}")


def _slurm_word(v: str | None) -> bool:
    return v is None or bool(SLURM_WORD.fullmatch(v))


def _slurm_time(v: str) -> bool:
    """True, or ValueError saying what is wrong (``'0' is no time at all``): a flag's message says why."""
    slurm_time.minutes(v)
    return True


def _skips(v: str) -> bool:
    """True, or ValueError saying what is wrong with a list of skipped steps (``skips.parse``)."""
    return skips.parse(v) is not None


def _size(v: str) -> bool:
    """A memory size as sbatch's ``--mem`` takes it: ``64G``, ``512M``, ``1T``."""
    return bool(re.fullmatch(r"\d+[KMGT]?B?", v, re.I))


def checked(
    default: Any = dataclasses.MISSING,
    *,
    check: Callable[[Any], bool] | None = None,
    expected: str = "",
    resumable: bool = False,
    key: str | None = None,
    default_factory: Any = dataclasses.MISSING,
    flags: tuple[str, ...] | None = None,
) -> Any:
    """A config field, declared once: its value check (``check(value)`` true, else "expected ..."; a check may
    raise ValueError saying why, which ``submit``'s flag for the key shows instead), whether it
    may change between the launches of one run (``resumable``), and its YAML key where the field's name
    cannot be it (``key``: ``checkpoint.async`` is the field ``async_save``)::

    lr: float = checked(1e-3, check=lambda v: v > 0, expected="a number > 0")
    root: str = checked("data", resumable=True)

    A section whose every key may change between launches says so once: ``RESUMABLE: ClassVar[bool] = True``.
    ``flags``: a ``slurm`` key's ``submit`` options where they are not ``--<name-with-dashes>`` (``()``: none).
    """
    meta: dict[str, Any] = {"check": (check, expected)} if check else {}
    if resumable:
        meta["resumable"] = True
    if key:
        meta["key"] = key
    if flags is not None:
        meta["flags"] = flags
    return field(default=default, default_factory=default_factory, metadata=meta)


@dataclass
class RunConfig:
    name: str | None = checked(
        None,
        check=lambda v: v is None or bool(RUN_NAME.fullmatch(v)),
        expected="null, or a name without '/' or spaces: letters, digits and . _ + = , - (not starting with . or -, "
        "at most 200)",
        resumable=True,  # a moved or renamed run directory computes the same thing
    )
    """Run name; the run directory is ``<output_root>/<name>``, and naming an existing one resumes it.
    Unset (null): each launch gets a new one, ``<task>-<date>-<time>``; inside a Slurm job
    ``<task>-<job id>``, so that a requeued job continues in it (``submit`` names it at submission)."""
    output_root: str = checked("runs", check=bool, expected="a non-empty path", resumable=True)
    """Directory holding run directories (relative paths are relative to the working directory)."""
    seed: int = checked(0, check=lambda v: 0 <= v < 2**32, expected="an integer from 0 to 4294967295")
    """Seed for model initialisation and the per-epoch data order (identical on every rank); 0 to 2**32-1."""
    shared: bool = False
    """A team run several users resume: directories 0770 and files 0660 instead of 0750/0640, and resume
    accepts a run directory or checkpoint writable by the group or owned by a member of it. Off: only
    your own files, not writable by the group, are resumed from (a co-tenant could plant a checkpoint)."""
    init_from: str | None = checked(
        None,
        check=lambda v: v is None or bool(v.strip()),
        expected="null, or a run directory or checkpoint file",
        resumable=True,
    )
    """Warm start: a NEW run begins from these weights, a run directory (its newest valid checkpoint) or a
    checkpoint file; the model must have the same keys and shapes. Step 0, a fresh schedule, this run's
    seed. Ignored when the run directory has checkpoints of its own (a resume: its own state wins).
    config.yaml records the checkpoint file used (docs/training.md, "Warm start")."""
    init_optimizer: bool = checked(False, resumable=True)
    """With ``run.init_from``: also take the optimizer's state (Adam's moments, SGD's momentum); the
    learning rate and schedule stay this run's."""


@dataclass
class TrainConfig:
    epochs: int = checked(4, check=lambda v: v >= 1, expected="an integer >= 1")
    """Passes over the training set."""
    global_batch_size: int = checked(64, check=lambda v: v >= 1, expected="an integer >= 1")
    """Samples per optimizer step over all ranks; each rank takes ``global_batch_size / world_size``."""
    lr: float = checked(4e-3, check=lambda v: v > 0, expected="a number > 0")
    """Peak learning rate (the one-cycle schedule's maximum; the constant rate otherwise)."""
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    """Optimizer; SGD uses Nesterov momentum 0.9."""
    weight_decay: float = checked(0.0, check=lambda v: v >= 0, expected="a number >= 0")
    """Weight decay (decoupled for ``adamw``)."""
    schedule: Literal["onecycle", "constant"] = "onecycle"
    """Learning-rate schedule over the whole run (``onecycle`` warms up then anneals)."""
    max_steps: int | None = checked(None, check=lambda v: v is None or v >= 1, expected="null or an integer >= 1")
    """Cap on optimizer steps (null: none). Reaching it ends training as if it were the last step."""
    log_every_steps: int = checked(20, check=lambda v: v >= 1, expected="an integer >= 1", resumable=True)
    """Steps between ``train`` lines in metrics.jsonl (the loss is averaged over them and over ranks)."""
    log_every_s: float = checked(30.0, check=lambda v: v > 0, expected="a number > 0", resumable=True)
    """Seconds between plain progress lines when stderr is not a terminal (batch logs)."""
    workers: int = checked(2, check=lambda v: v >= 0, expected="an integer >= 0", resumable=True)
    """DataLoader worker processes per rank for a task whose data is a Dataset (0: load in the training process)."""
    prefetch: int = checked(2, check=lambda v: v >= 1, expected="an integer >= 1", resumable=True)
    """Batches each worker prepares ahead (Dataset path)."""
    eval_batch_size: int = checked(256, check=lambda v: v >= 1, expected="an integer >= 1", resumable=True)
    """Samples per evaluation batch on each rank."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """``bf16`` runs forward/backward under bf16 autocast; refused on GPUs older than compute capability 8.0
    (no bf16 tensor cores). ``fp16``: fp16 autocast with a gradient scaler (checkpointed; a step whose gradients
    overflow is skipped and the scale halved), for GPUs without bf16; refused under dist.strategy=fsdp. On CPU
    both run under torch's CPU autocast, with a warning: for testing the GPU path, usually no faster. docs/gpu.md."""
    deterministic: bool = False
    """GPU runs repeat bit-for-bit and resume bit-identically: deterministic cuDNN/cuBLAS kernels (somewhat
    slower); an op without one raises. CPU runs are bit-exact either way. Guarantees: docs/determinism.md."""
    accumulate: int = checked(1, check=lambda v: v >= 1, expected="an integer >= 1")
    """Micro-batches per optimizer step: each rank's share of ``global_batch_size`` is split into this many,
    and gradients cross ranks only after the last one under ddp; under fsdp each one reduce-scatters into the
    sharded gradient (docs/scaling.md). Steps, checkpoints and stops count optimizer steps."""
    micro_batch_size: int | None = checked(
        None, check=lambda v: v is None or v >= 1, expected="null or an integer >= 1"
    )
    """Samples per rank per micro-batch. Set, each launch chooses the accumulation itself:
    ``global_batch_size / (world size x micro_batch_size)`` micro-batches per step, so that a job on any number
    of nodes (``sbatch --nodes=2-4``, a relaunch on the nodes left) keeps the global batch and the per-rank
    micro-batch; a world size it does not divide is refused (exit 2). Leave ``accumulate`` at 1 with it."""
    cuda_graphs: bool = False
    """Capture the whole step (forward, backward, optimizer; the schedule's rate in a device tensor) once
    as a CUDA graph and replay it: for small models, whose kernels take less time than launching them.
    World size 1, the runtime's fused optimizer, batches of one shape; refused on CPU. ``training_step`` runs
    only at the warm-up and the capture: a task with state of its own is refused, a schedule of anything but
    the learning rate stops training. docs/gpu.md."""
    grad_clip: float | None = checked(None, check=lambda v: v is None or v > 0, expected="null or a number > 0")
    """Clip gradients to this global L2 norm before each optimizer step (null: no clipping); the norm before
    clipping is logged as ``grad_norm``."""
    activation_checkpoint: bool = checked(False, resumable=True)
    """Keep only each unit's input for backward and recompute its forward there (the task's ``shard_units``;
    under ddp and fsdp alike): less activation memory for about one more forward per step. Non-reentrant and
    RNG-preserving: dropout, gradients and resume are bit-identical with it off, so it may be turned on or
    off between the launches of one run (after an out-of-memory). docs/scaling.md."""


@dataclass
class CheckpointConfig:
    RESUMABLE: ClassVar[bool] = True  # how a run is saved, placed or logged, not what it computes

    every_steps: int = checked(100, check=lambda v: v >= 0, expected="an integer >= 0")
    """Steps between checkpoints (0: only at epoch ends, the end of training and on a stop signal)."""
    keep: int = checked(3, check=lambda v: v >= 1, expected="an integer >= 1")
    """How many of the newest checkpoints to keep; the best (the task's ``best_metric``) is kept beside them."""
    async_save: bool = checked(True, key="async")
    """``checkpoint.async`` (YAML key ``async``; ``async_save`` only in Python, where ``async`` is a
    keyword): rank 0 copies the state to host memory and a background thread writes it, so training
    pauses only for the copy. Stop signals, the end of training and exit wait for the write to be
    durable. Falls back to synchronous saving when a copy of the state would not fit in memory."""


@dataclass
class EvalConfig:
    every_steps: int = checked(0, check=lambda v: v >= 0, expected="an integer >= 0")
    """Steps between evaluations on the test set, besides the one at the end of each epoch (0: only there).
    Every test sample is counted once at any world size; a stop signal is honoured at each evaluation batch.
    An evaluation that improves the task's ``best_metric`` is followed by a checkpoint, kept beside the
    ``checkpoint.keep`` newest and named in ``<run dir>/best``."""
    patience: int | None = checked(None, check=lambda v: v is None or v >= 1, expected="null or an integer >= 1")
    """Early stopping: end the run (exit 0, finished) after this many evaluations in a row that did not
    improve the task's ``best_metric`` by more than ``eval.min_delta`` (null: never stop early). The count
    and the best value are part of every checkpoint, so a requeued run stops where one left alone would."""
    min_delta: float = checked(0.0, check=lambda v: v >= 0, expected="a number >= 0")
    """How much an evaluation must beat the best value so far by to count as an improvement (early stopping)."""


@dataclass
class GuardConfig:
    RESUMABLE: ClassVar[bool] = True  # turned on, off or widened between launches; skips only drop data

    rollbacks: int = checked(0, check=lambda v: v >= 0, expected="an integer >= 0")
    """Rollbacks a run may make on a loss spike or a non-finite loss (0: the guard is off, and a non-finite loss
    stops the run, exit 1). Each goes back to the newest checkpoint before the suspect steps, replays them to
    tell bad data (skipped) from a faulty rank (named), and goes on; one more than this is exit 1. docs/guard.md."""
    spike: float | None = checked(10.0, check=lambda v: v is None or v > 0, expected="null or a number > 0")
    """A step's loss (the mean over ranks) counts as a spike when it exceeds the running mean by this many times
    the running mean absolute deviation (null: only a non-finite loss is detected). With ``rollbacks`` > 0."""
    warmup: int = checked(100, check=lambda v: v >= 1, expected="an integer >= 1")
    """Steps whose losses only feed the running statistics before spikes are judged (early losses fall fast)."""
    window: int = checked(100, check=lambda v: v >= 2, expected="an integer >= 2")
    """The running statistics' horizon in steps (an exponential average with weight 2/(window+1))."""
    suspect_steps: int = checked(1, check=lambda v: v >= 1, expected="an integer >= 1")
    """Steps, ending at the flagged one, whose data is suspect: no rollback lands inside them, and a replay
    that reproduces the spike skips them all."""
    skip: str | None = checked(
        None, check=lambda v: v is None or bool(_skips(v)), expected="null or step ranges like '1201-1400,1650'"
    )
    """Steps whose batches are never trained on, by hand (the guard adds its own): ``first-last`` ranges and
    single steps, comma-separated, as the log counts steps. A skipped step moves the data on without an
    update; every other step keeps its batch."""


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


RUNTIME_SECTIONS = ("run", "train", "eval", "checkpoint", "guard", "dist", "slurm", "log")
"""Sections every task shares; a task's own sections are the fields of its ``Config`` dataclass."""


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


@dataclass(eq=False)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    log: LogConfig = field(default_factory=LogConfig)
    task: str = taskref.DEFAULT
    """Which task trains: ``package.module:Name`` or ``path/to/file.py:Name`` (unset: built-in MNIST)."""
    task_config: Any = None
    """The task's own sections: an instance of its ``Config`` (the task imported), or ``Unchecked`` (the
    sections as given, the task not imported: a config read from a run); None: the task's defaults."""

    def __post_init__(self) -> None:
        if self.task_config is None:  # asked for by the caller, in Python: the task's defaults need the task
            self.task_config = task_class(self.task).Config()
        if not isinstance(self.task_config, Unchecked):
            # A task file by its absolute path from here on (imported, above, as typed: messages show it so):
            # the run directory's config.yaml then names it for a resume from anywhere. A config read back
            # (Unchecked) keeps what it says; relaunch compares both sides made absolute.
            self.task = taskref.absolute(self.task)

    @property
    def resolved(self) -> bool:
        """Whether the task was imported and its sections checked (``config.resolve``)."""
        return not isinstance(self.task_config, Unchecked)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the task's sections read like the runtime's (cfg.data.root).
        task_config = self.__dict__.get("task_config")
        if isinstance(task_config, Unchecked):
            found = task_config.section(name)
            if found is not None:
                return found
        elif task_config is not None and name in _keys(task_config):
            return getattr(task_config, name)
        raise AttributeError(f"config has no section {name!r}")

    def __eq__(self, other: object) -> bool:
        """The same keys and values (a config read back from its YAML equals the one written)."""
        return self.to_dict() == other.to_dict() if isinstance(other, Config) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  (mutable, compared by value)

    @property
    def run_dir(self) -> Path:
        if self.run.name is None:
            raise ValueError("run.name is not chosen yet (ddp_slurm.train.runname names new runs)")
        return Path(self.run.output_root) / self.run.name

    @property
    def paths(self) -> RunPaths:
        """The run directory's files, and ``run.shared`` for whoever writes them."""
        return RunPaths(self.run_dir, self.run.shared)

    def sections(self) -> dict[str, Any]:
        """Every checked section by name: the runtime's, then the task's (none while it is ``Unchecked``)."""
        own = {name: getattr(self, name) for name in RUNTIME_SECTIONS}
        if not self.resolved:
            return own
        return own | {name: getattr(self.task_config, name) for name in _keys(self.task_config)}

    def to_dict(self) -> dict[str, Any]:
        """``task`` and sections of ``{key: value}``, keyed as in YAML (``checkpoint.async``, not ``async_save``);
        an unresolved config's task sections as given."""
        out = {"task": self.task} | {
            name: {_key(f): getattr(sec, f.name) for f in dataclasses.fields(sec)}
            for name, sec in self.sections().items()
        }
        return out if self.resolved else out | self.task_config.sections()


def _keys(obj: Any) -> dict[str, str]:
    """``{key: field name}`` of a section."""
    return {_key(f): f.name for f in dataclasses.fields(obj)}


def task_class(spec: str) -> type:
    """The Task class named by ``spec``; ConfigError (exit 2) when it cannot be used."""
    try:
        cls = taskref.resolve(spec)
    except taskref.TaskError as exc:
        raise ConfigError(str(exc)) from None
    clash = set(_keys(cls.Config)) & {*RUNTIME_SECTIONS, "task", "log"}
    if clash:
        raise ConfigError(
            f"task={spec!r}: its Config reuses the runtime's section name(s) {sorted(clash)}: rename them"
        )
    return cls


def _key(f: dataclasses.Field) -> str:
    """A field's key in YAML and on the command line: its name, or ``metadata["key"]`` where the
    key is a Python keyword (``checkpoint.async`` is the field ``async_save``)."""
    return f.metadata.get("key", f.name)


def _field_types(obj: Any) -> Mapping[str, Any]:
    return _type_hints(type(obj))


@functools.cache
def _type_hints(cls: type) -> Mapping[str, Any]:
    """A section's field types, evaluated once per class: ``typing.get_type_hints`` compiles every
    annotation string again on each call, and a config is read per key (pruning compares the config
    of each kept checkpoint with the run's at every save: 30 ms of a 50 ms save was this)."""
    return types.MappingProxyType(typing.get_type_hints(cls))


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}
