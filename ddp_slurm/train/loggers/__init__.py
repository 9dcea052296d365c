"""Opt-in experiment loggers next to ``metrics.jsonl``: MLflow (``log.mlflow``), Weights & Biases
(``log.wandb``) and CSV files (``log.csv``); TensorBoard (``log.tensorboard``) is the fourth, in ``train/tb.py``.

Every logger is a *sink* of :class:`~ddp_slurm.train.metrics.MetricsWriter`: it gets exactly the records
written to metrics.jsonl (``write(kind, step, epoch, time_s, **fields)``), the sink-only ``checkpoint``
events, then ``close()``. Each logs every numeric field of every record generically, so a field added to
the train lines later (a gradient norm) reaches every logger without a change here.

Only rank 0 logs. A run directory is ONE logger run across requeues and relaunches: the logger's run id
is kept in ``<run_dir>/loggers.json`` (:mod:`.runids`) and reused by the next launch. A logger that fails
(package missing, server down, an exception while logging) says so in one warning and is switched off:
it never stops training (:class:`.guard.Guarded`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp_slurm.config import Config
from ddp_slurm.train.loggers.guard import Guarded
from ddp_slurm.train.loggers.runids import RunIds


def open_sinks(cfg: Config, run_dir: Path, rank: int) -> list[Any]:
    """The loggers asked for in ``log.*`` (rank 0 only), each guarded; empty when none is on."""
    if rank != 0:
        return []
    ids = RunIds(Path(run_dir), cfg.run.shared)
    sinks: list[Any] = []
    if cfg.log.csv:
        from ddp_slurm.train.loggers.csv_logger import CsvSink

        sinks.append(Guarded("log.csv", lambda: CsvSink(Path(run_dir))))
    if cfg.log.mlflow is not False:
        from ddp_slurm.train.loggers.mlflow_logger import MlflowSink

        sinks.append(Guarded("log.mlflow", lambda: MlflowSink(cfg, Path(run_dir), ids)))
    if cfg.log.wandb is not False:
        from ddp_slurm.train.loggers.wandb_logger import WandbSink

        sinks.append(Guarded("log.wandb", lambda: WandbSink(cfg, Path(run_dir), ids)))
    return sinks
