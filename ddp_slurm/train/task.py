"""The Task interface: what a user writes to train their own model with every guarantee of the runtime.

A task says what to train; the runtime (``ddp_slurm.train``) does everything else: ranks and the process
group, the DDP wrapper, the optimizer step, bf16 autocast, the loop, evaluation sharded so that every
sample counts once, the stop vote, atomic verified checkpoints (model, optimizer, schedule, every rank's
RNG streams, the data loader's position and the task's own state), requeue and exact resume::

    @dataclass
    class DigitsData:
        root: str = "data"
        \"\"\"Where the files are.\"\"\"

    @dataclass
    class DigitsConfig:            # each field is a config section: data.root=... on the command line
        data: DigitsData = field(default_factory=DigitsData)

    class Digits(Task):
        Config = DigitsConfig
        best_metric = "accuracy"

        def build_model(self):                      return Net()
        def train_data(self):                       return Tensors(images, labels)   # or any map-style Dataset
        def training_step(self, model, batch):      x, y = batch; return F.cross_entropy(model(x), y)
        def eval_data(self):                        return Tensors(test_images, test_labels)
        def eval_step(self, model, batch):          x, y = batch; return {"accuracy": (model(x).argmax(1) == y).sum()}

``python -m ddp_slurm.train task=my_project.tasks:Digits data.root=/scratch/digits`` (or
``task=path/to/file.py:Digits``, or ``ddp_slurm.run(Digits, overrides)``). docs/tasks.md walks through it.

Resolving ``task=...`` to a class is the config layer's job (``ddp_slurm.taskref``); this module is what
a task imports.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch
    from torch import nn


class Tensors:
    """Training or evaluation data held in memory as tensors of equal length (the fast path).

    The runtime moves them to the rank's device once and builds each batch by indexing: no worker
    processes, no collation, no per-sample Python. Batches are tuples in the order given.
    Use it when the data fits in (device) memory; otherwise return a map-style ``Dataset``.

    ``len()`` is the number of samples; ``.tensors`` holds the tensors, which also unpack:
    ``images, labels = task.eval_data()`` (inputs prepared as the task prepares them, e.g. for an exported model).
    """

    def __init__(self, *tensors: torch.Tensor) -> None:
        if not tensors:
            raise ValueError("Tensors() needs at least one tensor")
        n = tensors[0].shape[0]
        if any(t.shape[0] != n for t in tensors):
            raise ValueError(f"Tensors(): first dimensions differ ({[t.shape[0] for t in tensors]})")
        self.tensors = tensors

    def __len__(self) -> int:
        return self.tensors[0].shape[0]

    def __iter__(self) -> Iterator[torch.Tensor]:
        """The tensors, in the order given (``x, y = data``), not the samples."""
        return iter(self.tensors)

    def to(self, device: torch.device) -> Tensors:
        return Tensors(*(t.to(device) for t in self.tensors))


@dataclass(frozen=True)
class Context:
    """Where a task runs: handed to the task's constructor, read-only."""

    rank: int
    """This process's rank (0 .. world_size - 1)."""
    world_size: int
    """Number of ranks."""
    local_rank: int
    """Rank on this node."""
    device: torch.device
    """The device this rank computes on (``cuda:N`` or ``cpu``); batches arrive on it."""
    seed: int
    """``run.seed``: the model is built right after ``torch.manual_seed(seed)`` on every rank."""
    run_dir: Path
    """The run directory (rank 0 writes it); a task may keep its own files under it."""
    global_batch_size: int
    """Samples per optimizer step over all ranks; each rank's batch holds ``global_batch_size // world_size``."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class NoConfig:
    """A task without config keys of its own."""


class Task:
    """Subclass it; override the four required methods, and the optional ones where the default does
    not fit. ``self.config`` is the task's ``Config`` instance (validated), ``self.ctx`` the Context."""

    Config: ClassVar[type] = NoConfig
    """A dataclass whose fields are config sections, each a dataclass of typed, documented keys. Value
    checks and resumable keys are field metadata (``ddp_slurm.config.checked``). Section names must not be
    the runtime's (run, train, checkpoint, dist, slurm, log)."""
    best_metric: ClassVar[str | None] = None
    """An evaluation metric whose best value is tracked and reported (e.g. ``"accuracy"``)."""
    higher_is_better: ClassVar[bool] = True
    """Whether a larger ``best_metric`` is better."""
    percent_metrics: ClassVar[tuple[str, ...] | None] = None
    """Evaluation metrics that are fractions (0 to 1), shown x100 with a % sign in the log, ``report`` and
    sweeps. None: those whose name contains ``accuracy``; ``()`` for none (a metric already in percent)."""

    def __init__(self, config: Any, ctx: Context) -> None:
        self.config = config
        self.ctx = ctx

    # -- required --------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The model, on the CPU (the runtime moves it to the device and wraps it in DDP)."""
        raise NotImplementedError

    def train_data(self) -> Any:
        """Training data: ``Tensors(...)`` (in memory), a map-style ``torch.utils.data.Dataset``, or
        ``ddp_slurm.Shards(path, decode)`` (WebDataset tar shards). The runtime orders it per epoch from
        ``(run.seed, epoch)`` and shards each global batch."""
        raise NotImplementedError

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of one batch (already on the device). The runtime runs backward, all-reduces
        the gradients, steps the optimizer and the schedule. Randomness here (dropout, augmentation)
        comes from this rank's checkpointed RNG streams."""
        raise NotImplementedError

    # -- optional --------------------------------------------------------------------------------
    def check(self) -> None:
        """Config errors found before anything starts (raise ``ddp_slurm.config.ConfigError``); the
        world size and batch size are in ``self.ctx``."""

    def prepare_data(self) -> None:
        """Rank 0 only, before any rank reads data: download, unpack, generate. Others wait for it."""

    def eval_data(self) -> Any:
        """Evaluation data (``Tensors``, a Dataset or ``Shards``), or None for no evaluation. Each sample is
        evaluated exactly once, whatever the world size."""
        return None

    def eval_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per-batch SUMS of per-sample metrics (``{"accuracy": correct.sum(), "loss": loss_sum}``); the
        runtime adds them over batches and ranks and divides by the number of samples."""
        raise NotImplementedError(f"{type(self).__name__}.eval_data() returned data but eval_step is missing")

    def configure_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        """Return an optimizer for ``model``'s parameters, or None for the runtime's (``train.optimizer``,
        ``train.lr``, ``train.weight_decay`` on its fastest fused path)."""
        return None

    def configure_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any | None:
        """Return an LR scheduler stepped once per optimizer step, or None for ``train.schedule``."""
        return None

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """``dist.strategy=fsdp``: the submodules sharded as one unit each (gathered for their forward and
        backward, freed after), the model itself taking the rest. Default: every direct child holding
        parameters; a transformer returns its blocks. ``train.activation_checkpoint=true`` recomputes each
        unit's forward in backward, under ddp and fsdp alike."""
        return default_units(model)

    def train_log(self) -> dict[str, float]:
        """Numbers of the task's own to add to each ``train`` line of metrics.jsonl (and so to every logger:
        ``train/<name>``), read on rank 0 at each line: host values (an EMA's decay, a temperature); a tensor
        here is read with ``.item()``, a wait for the device once per line. A name the runtime's line already
        has (``loss``, ``lr``, ...) is refused."""
        return {}

    def hooks(self) -> list[Any]:
        """Side features of the task's own (``ddp_slurm.Hook`` subclasses), called at the loop's points after the
        runtime's. A hook with state returns its checkpoint parts from ``parts()`` (``ddp_slurm.Stateful``): they
        are saved with every checkpoint and put back on a resume (docs/tasks.md, 'Side features')."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """The task's own state to checkpoint (tensors and plain values), beyond model and optimizer."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every direct child of ``model`` that holds parameters (``Task.shard_units``' default)."""
    return [child for child in model.children() if next(child.parameters(), None) is not None]
