"""MLflow: ``log.mlflow=true`` (a file store in ``<run_dir>/mlruns``) or ``log.mlflow=URI`` (any tracking URI).

Uses :class:`mlflow.tracking.MlflowClient` rather than the fluent ``mlflow.start_run`` API: no active-run
state in the process, and the run id is ours to keep. The first launch creates the run in experiment
``$MLFLOW_EXPERIMENT_NAME`` (default ``ddp_slurm``), logs the resolved config as params and saves the id in
``loggers.json``; every later launch reopens that run (status back to RUNNING) and appends. The run ends
FINISHED after the ``end`` record, KILLED after a stop signal (it resumes on the next launch), FAILED
otherwise. Metrics are ``<kind>/<field>`` (``train/loss``, ``eval/mse``), events ``events/<kind>`` (``events/checkpoint``) valued at their step, batched:
train records are sent every few seconds, everything else at once.

The run's own file store (``log.mlflow=true``) is a folder MLflow writes with plain ``open``: it must be
ours, with no link inside (:func:`.folders.library_folder`), or the logger is refused. For an HTTP
server, :func:`set_defaults` shortens MLflow's own patience (minutes of retries by default) unless the
environment sets it; the logger's thread (:mod:`.boundary`) is what keeps a server that never answers
away from training either way.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ddp_slurm.config import Config
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.loggers.fields import flat_config, numeric
from ddp_slurm.train.loggers.folders import library_folder
from ddp_slurm.train.loggers.runids import RunIds

HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",  # seconds per request (MLflow: 120)
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",  # MLflow: 7, with a doubling backoff: minutes per call
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}
FLUSH_EVERY_S = 5.0
_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_PARAM_CHARS = 6000


def set_defaults(setting: bool | str) -> None:
    """MLflow's settings for ``log.mlflow=setting`` where the environment has none. Called from the
    training thread before the logger's thread starts: the environment is changed by one thread only."""
    uri = "file:" if setting is True else str(setting)
    if uri.startswith("file:") or "://" not in uri:
        # A local file store is what was asked for: MLflow 3 refuses one unless told it is on purpose.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    elif uri.startswith(("http:", "https:")):
        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)


def tracking_uri(setting: bool | str, paths: RunPaths) -> str:
    """``true``: the run's own file store (checked: see the module doc); a string: the tracking URI as given."""
    if setting is True:
        return library_folder(paths.mlruns, paths.shared).resolve().as_uri()
    return str(setting)


class MlflowSink:
    def __init__(self, cfg: Config, paths: RunPaths, ids: RunIds) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric_cls = Metric
        uri = tracking_uri(cfg.log.mlflow, paths)
        self.client = MlflowClient(tracking_uri=uri)
        saved = ids.get("mlflow")
        if saved and saved.get("tracking_uri") == uri:
            self.run_id = str(saved["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddp_slurm"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
            tags = {"run_dir": str(paths.root.resolve())}
            run = self.client.create_run(experiment, run_name=paths.root.name, tags=tags)
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
