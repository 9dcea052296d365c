"""MLflow: ``log.mlflow=true`` (a file store in ``<run_dir>/mlruns``) or ``log.mlflow=URI`` (any tracking URI).

Uses :class:`mlflow.tracking.MlflowClient` rather than the fluent ``mlflow.start_run`` API: no active-run
state in the process, and the run id is ours to keep. The first launch creates the run in experiment
``$MLFLOW_EXPERIMENT_NAME`` (default ``ddp_slurm``), logs the resolved config as params and saves the id in
``loggers.json``; every later launch reopens that run (status back to RUNNING) and appends. The run ends
FINISHED after the ``end`` record, KILLED after a stop signal (it resumes on the next launch), FAILED
otherwise. Metrics are ``<kind>/<field>`` (``train/loss``, ``eval/mse``), events ``events/<kind>`` (``events/checkpoint``) valued at their step, batched:
train records are sent every few seconds, everything else at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ddp_slurm.config import Config
from ddp_slurm.train.loggers.fields import flat_config, numeric
from ddp_slurm.train.loggers.runids import RunIds

STORE = "mlruns"
FLUSH_EVERY_S = 5.0
_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_PARAM_CHARS = 6000


def tracking_uri(setting: bool | str, run_dir: Path) -> str:
    """``true``: the run's own file store; a string: the tracking URI as given."""
    uri = (run_dir / STORE).resolve().as_uri() if setting is True else str(setting)
    if uri.startswith("file:") or "://" not in uri:
        # A local file store is what was asked for: MLflow 3 refuses one unless told it is on purpose.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


class MlflowSink:
    def __init__(self, cfg: Config, run_dir: Path, ids: RunIds) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric_cls = Metric
        uri = tracking_uri(cfg.log.mlflow, run_dir)
        self.client = MlflowClient(tracking_uri=uri)
        saved = ids.get("mlflow")
        if saved and saved.get("tracking_uri") == uri:
            self.run_id = str(saved["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddp_slurm"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
            run = self.client.create_run(experiment, run_name=run_dir.name, tags={"run_dir": str(run_dir.resolve())})
            self.run_id = run.info.run_id
            ids.put("mlflow", {"run_id": self.run_id, "tracking_uri": uri})
            params = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in flat_config(cfg).items()]
            for i in range(0, len(params), 100):  # MLflow's limit of params per call
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self._pending: list[Any] = []
        self._flushed = time.monotonic()
        self._last_kind = ""

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        now = int(time.time() * 1000)
        values = {f"{kind}/{k}": v for k, v in numeric(fields).items()}
        if kind in ("train", "eval"):
            values[f"{kind}/epoch"] = float(epoch)
        else:  # start, stop, end, checkpoint: the event, at its step
            values[f"events/{kind}"] = float(step)
        self._pending += [self._metric_cls(k, v, now, step) for k, v in values.items()]
        self._last_kind = kind
        if kind != "train" or time.monotonic() - self._flushed >= FLUSH_EVERY_S:
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), _BATCH):
            self.client.log_batch(self.run_id, metrics=pending[i : i + _BATCH])
        self._flushed = time.monotonic()

    def close(self) -> None:
        self._flush()
        status = {"end": "FINISHED", "stop": "KILLED"}.get(self._last_kind, "FAILED")
        self.client.set_terminated(self.run_id, status)
