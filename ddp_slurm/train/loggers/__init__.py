"""Opt-in experiment loggers next to ``metrics.jsonl``: MLflow (``log.mlflow``), Weights & Biases
(``log.wandb``), CSV files (``log.csv``) and TensorBoard (``log.tensorboard``).

Every logger is a *sink* of :class:`~ddp_slurm.train.metrics.MetricsWriter`: it gets exactly the records
written to metrics.jsonl (``write(kind, step, epoch, time_s, **fields)``), the sink-only ``checkpoint``
events, then ``close()``. Each logs every numeric field of every record generically, so a field added to
the train lines later (a gradient norm) reaches every logger without a change here.

Only rank 0 logs. A run directory is ONE logger run across requeues and relaunches: the logger's run id
is kept in ``<run_dir>/loggers.json`` (:mod:`.runids`) and reused by the next launch. A logger never stops
training: each runs in its own thread behind a bounded queue (:mod:`.boundary`), so a server that never
answers cannot hold the training thread; one that fails (package missing, server down, a folder that is
not ours, an exception while logging) says so in one warning and is switched off (:class:`.guard.Guarded`).

:func:`require` and :func:`open_sinks` are the two calls training makes: one before anything starts, one
once the run directory is known.
"""

from __future__ import annotations

import importlib.util

from ddp_slurm.config import Config, ConfigError
from ddp_slurm.train.loggers.boundary import Boundary
from ddp_slurm.train.loggers.runids import RunIds


def require(cfg: Config) -> None:
    """Raise ConfigError (exit 2, before any work) when ``log.tensorboard`` is on and TensorBoard is
    missing: asking for it is asking for a local file, which needs nothing but the package. (MLflow and
    W&B missing are a warning when the logger opens, like their server being down.)"""
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "log.tensorboard=true needs the tensorboard package: pip install 'ddp_slurm[tensorboard]' "
            "(or run with log.tensorboard=false)"
        )


def open_sinks(cfg: Config, rank: int) -> list[Boundary]:
    """Every logger asked for in ``log.*`` on rank 0, each guarded and behind its own bounded queue
    (opened in its thread: this returns at once); empty on other ranks and when none is on."""
    if rank != 0:
        return []
    paths = cfg.paths
    ids = RunIds(paths)
    sinks: list[Boundary] = []
    if cfg.log.tensorboard:
        from ddp_slurm.train.loggers.tensorboard_logger import TensorBoardSink

        sinks.append(Boundary("log.tensorboard", lambda: TensorBoardSink(paths)))
    if cfg.log.csv:
        from ddp_slurm.train.loggers.csv_logger import CsvSink

        sinks.append(Boundary("log.csv", lambda: CsvSink(paths)))
    if cfg.log.mlflow is not False:
        from ddp_slurm.train.loggers import mlflow_logger

        mlflow_logger.set_defaults(cfg.log.mlflow)  # here: the environment is changed by this thread only
        sinks.append(Boundary("log.mlflow", lambda: mlflow_logger.MlflowSink(cfg, paths, ids)))
    if cfg.log.wandb is not False:
        from ddp_slurm.train.loggers.wandb_logger import WandbSink

        sinks.append(Boundary("log.wandb", lambda: WandbSink(cfg, paths, ids)))
    return sinks
