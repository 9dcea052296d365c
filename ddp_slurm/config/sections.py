"""The sections about what a run computes and keeps: ``run``, ``train``, ``eval``, ``checkpoint`` and ``guard``,
and ``checked``, the declaration every field of the config's schema is made with (``schema.py`` puts the
sections together; ``placement.py`` holds ``dist``, ``slurm`` and ``log``).

A field carries its type, its default, its docstring (the printed reference, ``doc.py``) and, through
``checked``, its value check, whether it may change between the launches of one run, its YAML key and
(``slurm`` only) its ``submit`` flags. A section whose every key may change says so once (``RESUMABLE``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ddp_slurm import skips

# A run name becomes a directory, a Slurm job name and part of the job script: a safe character set.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=,-]{0,199}")


def _skips(v: str) -> bool:
    """True, or ValueError saying what is wrong with a list of skipped steps (``skips.parse``)."""
    return skips.parse(v) is not None


def _drops(v: str) -> bool:
    """True, or ValueError saying what is wrong with a list of samples left out (``skips.parse_samples``)."""
    return skips.parse_samples(v) is not None


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
    drop: str | None = checked(
        None,
        check=lambda v: v is None or bool(_drops(v)),
        expected="null or samples like '300,512@2' (or shard.tar:key names)",
    )
    """Samples never trained on, by hand (the guard adds those it finds bad): dataset indices (or, for
    ``Shards``, ``shard.tar:key`` names as the guard names them), comma-separated, each left out of every
    epoch, or from epoch E on with ``INDEX@E`` (epochs counted from 0, as metrics.jsonl counts them). A sample left out leaves its global batch one smaller; every other sample keeps its place."""
