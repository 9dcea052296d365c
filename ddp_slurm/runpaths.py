"""A run directory's layout, named once: every file and folder the package writes or reads in one.

``<run.output_root>/<run.name>/`` holds what training, the launchers and the tools share::

    config.yaml      the resolved config (rundir.prepare writes it; a resume compares against it)
    metrics.jsonl    rank 0's records, one JSON object per line (train/metrics.py)
    checkpoints/     step-<N>.pt, atomically written, the last checkpoint.keep kept (train/checkpoint/)
    .lock            the flock one launch holds while it trains (train/rundir.py)
    tensorboard/     event files with log.tensorboard=true (train/tb.py)
    submitit/        the logs and pickles of jobs sent by ``submit`` (launch/plan.py, tools/jobacct.py)
    report.png       the plots of ``report`` (tools/report.py)

``shared`` is ``run.shared``: the modes of what is written there (a team run several users resume), and
whether a teammate's file may be trusted. It travels with the paths because every writer of the
directory needs both. Torch-free: the launchers and tools import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    """The files of one run directory (``root``); ``shared``: ``run.shared``."""

    root: Path
    shared: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int | str) -> Path:
        """``checkpoints/step-<N>.pt``, the checkpoint of step N (``step`` may be a glob, ``"*"``)."""
        return self.checkpoints / f"step-{step}.pt"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def submitit(self) -> Path:
        return self.root / "submitit"

    @property
    def report(self) -> Path:
        return self.root / "report.png"

    def is_run(self) -> bool:
        """Whether ``root`` looks like a run directory (a config or metrics written by a launch)."""
        return self.config.is_file() or self.metrics.is_file()
