"""Weights & Biases: ``log.wandb=true`` (project ``ddp_slurm``) or ``log.wandb=PROJECT``.

The run id is chosen before ``wandb.init`` and kept in ``loggers.json``: every launch of the run calls
``wandb.init(id=..., resume="allow")``, so a requeued job continues the same W&B run (offline, each launch
writes its own ``<run_dir>/wandb/offline-run-*-ID`` directory with that one id: ``wandb sync`` them
together). Metrics are ``<kind>/<field>`` against ``global_step`` (``define_metric``), not W&B's own step
counter, which must only grow: a step redone after a resume is logged, not dropped. W&B's console
capture and system-stats sampling are off: the training log stays ours. ``WANDB_MODE``, ``WANDB_ENTITY``
and the other ``WANDB_*`` variables keep their meaning.
"""

from __future__ import annotations

import secrets
import string
from typing import Any

from ddp_slurm.config import Config
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.loggers.fields import numeric
from ddp_slurm.train.loggers.runids import RunIds

STEP = "global_step"


class WandbSink:
    def __init__(self, cfg: Config, paths: RunPaths, ids: RunIds) -> None:
        import wandb

        project = cfg.log.wandb if isinstance(cfg.log.wandb, str) else "ddp_slurm"
        saved = ids.get("wandb")
        if saved and saved.get("project") == project:
            run_id = str(saved["id"])
        else:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            ids.put("wandb", {"id": run_id, "project": project})  # before init: a crash inside keeps the id
        self.run = wandb.init(
            project=project,
            id=run_id,
            resume="allow",
            name=paths.root.name,
            dir=str(paths.root),
            config=cfg.to_dict(),
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP, step_sync=True)
        self._last_kind = ""

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        values = {f"{kind}/{k}": v for k, v in numeric(fields).items()}
        if kind in ("train", "eval"):
            values[f"{kind}/epoch"] = epoch
        else:  # start, stop, end, checkpoint: the event at its step
            values[f"events/{kind}"] = step
        self.run.log({**values, STEP: step, "time_s": time_s})
        self._last_kind = kind

    def close(self) -> None:
        if self._last_kind == "stop":
            self.run.mark_preempting()  # resumed by the next launch
        self.run.finish(exit_code=0 if self._last_kind in ("end", "stop") else 1)
