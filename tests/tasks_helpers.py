"""Helpers shared by tests/test_tasks.py and tests/cluster/test_tasks_cluster.py.

``LINE_TASK`` is the source of a third, minimal task that nothing in the package names: the complete
example of docs/tasks.md, read from the page (what the tests train is what the page shows). A test
writes it to a file and selects it by path (``task=line_task.py:Line``), as a user would. The
example task lives in ``examples/addition``; ``ADDITION_TINY`` sizes it for tests (seconds, not
minutes: what is tested is the runtime, not how well it learns).
"""

from __future__ import annotations

from pathlib import Path

from docs_commands import files

REPO = Path(__file__).resolve().parents[1]
ADDITION = f"{REPO / 'examples' / 'addition' / 'task.py'}:Addition"

# The example of docs/tasks.md, as a reader copies it, and two classes that only look like tasks.
LINE_TASK = (
    files(REPO / "docs" / "tasks.md")["line.py"]
    + '''

class NotATask:
    """Looks like a task, is not a ddp_slurm.Task."""

    def build_model(self):
        return nn.Linear(1, 1)


class Incomplete(Task):
    """A Task without training_step."""

    def build_model(self):
        return nn.Linear(1, 1)

    def train_data(self):
        return Tensors(torch.zeros(4, 1))
'''
)

LINE_RUN = [
    "train.epochs=3",
    "train.global_batch_size=32",
    "train.optimizer=sgd",
    "train.lr=0.5",
    "train.schedule=constant",
    "train.log_every_steps=4",
]
"""A short Line training: 8 steps per epoch, 24 in all."""


def write_line_task(folder: Path) -> Path:
    path = folder / "line_task.py"
    path.write_text(LINE_TASK)
    return path


def addition_tiny(
    epochs: int = 2, global_batch: int = 64, train_size: int = 2048, data_root: str = "data"
) -> list[str]:
    """The addition example sized for a test: ``train_size // global_batch`` steps per epoch, a small
    model (dropout and the operand swap on), the Dataset path with 2 workers per rank."""
    return [
        f"task={ADDITION}",
        f"data.train_size={train_size}",
        "data.test_size=256",
        f"data.root={data_root}",
        "model.width=32",
        "model.layers=1",
        "model.dropout=0.2",
        "data.swap_prob=0.5",
        "train.workers=2",
        f"train.epochs={epochs}",
        f"train.global_batch_size={global_batch}",
        "train.lr=3e-3",
        "train.log_every_steps=2",
        "checkpoint.every_steps=10",
        "checkpoint.keep=100",
    ]


# The Line task made slow on purpose, for the evaluation tests (tests/test_resume.py): each training step
# and each evaluation batch sleeps, and each evaluation batch appends "<time> <rank> <samples>" to a file,
# so that a test can send a signal while an evaluation is under way and see how soon it was abandoned.
SLOW_LINE_TASK = (
    LINE_TASK
    + '''

import os
import time


@dataclass
class SlowSection:
    train_sleep_s: float = 0.0
    eval_sleep_s: float = 0.0
    eval_log: str | None = None


@dataclass
class SlowLineConfig(LineConfig):
    slow: SlowSection = field(default_factory=SlowSection)


class SlowLine(Line):
    """Line, with a sleep in each training step and each evaluation batch."""

    Config = SlowLineConfig

    def training_step(self, model, batch):
        time.sleep(self.config.slow.train_sleep_s)
        return super().training_step(model, batch)

    def eval_step(self, model, batch):
        if self.config.slow.eval_log:
            with open(self.config.slow.eval_log, "a") as f:
                f.write(f"{time.time()} {os.environ.get('RANK', '0')} {len(batch[0])}\\n")
        time.sleep(self.config.slow.eval_sleep_s)
        return super().eval_step(model, batch)
'''
)


SLOW_LINE_RUN = [
    "task=slow_line_task.py:SlowLine",
    "train.global_batch_size=32",
    "train.optimizer=sgd",
    "train.lr=0.1",
    "train.schedule=constant",
    "train.log_every_steps=4",
    "train.eval_batch_size=10",
    "eval.every_steps=4",
    "checkpoint.every_steps=0",
]
"""The slow Line task's training: 8 steps per epoch, an evaluation every 4 steps of its 100 samples in batches
of 10 per rank; checkpoints only where a stop or an evaluation asks for one."""


def write_slow_line_task(folder: Path) -> Path:
    path = folder / "slow_line_task.py"
    path.write_text(SLOW_LINE_TASK)
    return path
