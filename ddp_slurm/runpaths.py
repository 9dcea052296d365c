"""A run directory's layout, named once: every file and folder the package writes or reads in one.

``<run.output_root>/<run.name>/`` holds what training, the launchers and the tools share::

    config.yaml      the resolved config (rundir.take writes it; a resume compares against it)
    metrics.jsonl    rank 0's records, one JSON object per line (train/metrics.py)
    checkpoints/     step-<N>.pt (ddp) or step-<N>/ (fsdp, a folder of shards, written as
                     .step-<N>.partial/ and renamed when committed); the last checkpoint.keep kept
    best             the name of the best checkpoint (train/checkpoint/best.py)
    set-aside/       checkpoints newer than the step ``resume --step N`` went back to (train/rewind.py)
    .lock            the lock one launch holds while it trains (train/rundir.py)
    lost_nodes       hosts a run lost a rank on, one line each (slurmjob/badnodes.py)
    chain/           the batch scripts of chained successor jobs, <job id>.sh (slurmjob/chain.py)
    loggers.json     each logger's run id, so every launch logs into one logger run (train/loggers/)
    tensorboard/     event files with log.tensorboard=true
    csv/             train.csv, eval.csv, events.csv with log.csv=true
    mlruns/          MLflow's file store with log.mlflow=true
    submitit/        the logs and pickles of jobs sent by ``submit`` (launch/plan.py, tools/jobacct.py)
    report.png       the plots of ``report`` (tools/report.py)

A sweep directory holds ``sweep.json`` (what was submitted) beside its runs' directories.

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

    def sharded(self, step: int | str) -> Path:
        """``checkpoints/step-<N>/``, the sharded checkpoint (a folder) of step N (``step`` may be a glob)."""
        return self.checkpoints / f"step-{step}"

    def partial(self, step: int | str) -> Path:
        """``checkpoints/.step-<N>.partial/``: a sharded checkpoint being written, renamed once committed."""
        return self.checkpoints / f".step-{step}.partial"

    @property
    def best(self) -> Path:
        """``best``: the name of the checkpoint at the best value of the task's metric (kept outside
        ``checkpoint.keep``); ``run.init_from=<run dir>/best`` starts from it."""
        return self.root / "best"

    @property
    def set_aside(self) -> Path:
        """``set-aside/``: ``<when>-after-step-<N>/`` folders of the checkpoints ``resume --step N`` moved
        out of ``checkpoints/`` (newer than the step it went back to), never deleted by the package."""
        return self.root / "set-aside"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def lost_nodes(self) -> Path:
        return self.root / "lost_nodes"

    @property
    def slow_nodes(self) -> Path:
        """``slow_nodes``: hosts a run named slow, one line each, as ``lost_nodes`` (``slurm.exclude_slow``)."""
        return self.root / "slow_nodes"

    @property
    def guard(self) -> Path:
        """``guard.jsonl``: the guard's rollbacks and skipped steps, one JSON line each (``train/guard/``)."""
        return self.root / "guard.jsonl"

    @property
    def chain(self) -> Path:
        return self.root / "chain"

    def chain_script(self, job_id: str) -> Path:
        return self.chain / f"{job_id}.sh"

    @property
    def loggers(self) -> Path:
        return self.root / "loggers.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def csv(self) -> Path:
        return self.root / "csv"

    @property
    def mlruns(self) -> Path:
        return self.root / "mlruns"

    @property
    def sweep(self) -> Path:
        """``sweep.json`` of a sweep directory (``root`` is the sweep's folder, not one of its runs)."""
        return self.root / "sweep.json"

    @property
    def submitit(self) -> Path:
        return self.root / "submitit"

    @property
    def report(self) -> Path:
        return self.root / "report.png"

    def is_run(self) -> bool:
        """Whether ``root`` looks like a run directory (a config or metrics written by a launch)."""
        return self.config.is_file() or self.metrics.is_file()
