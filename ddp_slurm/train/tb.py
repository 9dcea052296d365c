"""TensorBoard event files next to ``metrics.jsonl``: ``log.tensorboard=true``, then ``tensorboard --logdir runs``.

:class:`TensorBoardWriter` takes exactly the records that ``MetricsWriter.write`` gets (``kind``,
``step``, ``epoch``, ``time_s`` and the kind's fields) and turns every number into a scalar named
``<kind>/<field>`` (``train/loss``, ``train/lr``, ``eval/accuracy``, ...) at that step; a launch
(``start``), a stop signal and the end become text entries. Only rank 0 writes, like metrics.jsonl.

The ``tensorboard`` package is optional (``pip install ddp_slurm[tensorboard]``): :func:`require`
says so in one line before training starts, instead of failing at the first record.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ddp_slurm.config import Config, ConfigError
from ddp_slurm.runpaths import RunPaths

_POSITION = ("kind", "step", "epoch", "time_s")


def require(cfg: Config) -> None:
    """Raise ConfigError (exit 2, before any work) when ``log.tensorboard`` is on and TensorBoard is missing."""
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "log.tensorboard=true needs the tensorboard package: pip install 'ddp_slurm[tensorboard]' "
            "(or run with log.tensorboard=false)"
        )


class TensorBoardWriter:
    """Scalars of metrics.jsonl records as TensorBoard events under ``<run_dir>/tensorboard``."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self.log_dir = RunPaths(run_dir).tensorboard
        # One events file per launch, in one directory: TensorBoard shows a resumed run as one curve.
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        """The same call as ``MetricsWriter.write``."""
        if kind in ("train", "eval"):
            self._writer.add_scalar(f"{kind}/epoch", epoch, step)
            for name, value in fields.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(f"{kind}/{name}", value, step)
        else:  # start, stop, end: what happened, when
            detail = ", ".join(f"{k}={v}" for k, v in fields.items())
            self._writer.add_text(
                f"events/{kind}", f"{kind} at step {step} (epoch {epoch}, {time_s:.1f} s) {detail}", step
            )
        if kind != "train":  # train lines come often; the writer flushes them in the background
            self._writer.flush()

    def write_record(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl as read back (``metrics.read``): replays a finished run into TensorBoard."""
        position = {k: record[k] for k in _POSITION}
        self.write(**position, **{k: v for k, v in record.items() if k not in _POSITION})

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def open_for(cfg: Config, run_dir: Path, rank: int) -> TensorBoardWriter | None:
    """The writer the loop keeps next to its MetricsWriter: rank 0 with ``log.tensorboard`` on, else None."""
    if rank != 0 or not cfg.log.tensorboard:
        return None
    return TensorBoardWriter(run_dir)
