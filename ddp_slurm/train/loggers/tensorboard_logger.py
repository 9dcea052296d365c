"""TensorBoard event files: ``log.tensorboard=true`` writes ``<run_dir>/tensorboard/``, then ``tensorboard --logdir runs``.

:class:`TensorBoardSink` takes exactly the records that ``MetricsWriter.write`` gets (``kind``,
``step``, ``epoch``, ``time_s`` and the kind's fields) and turns every number into a scalar named
``<kind>/<field>`` (``train/loss``, ``train/lr``, ``eval/accuracy``, ...) at that step; a launch
(``start``), a stop signal and the end become text entries. One events file per launch, in one
folder: TensorBoard shows a resumed run as one curve.

TensorBoard writes its files with a plain ``open``: the folder must be ours with no link inside
(:func:`.folders.library_folder`), or the logger is refused. The ``tensorboard`` package is optional
(``pip install ddp_slurm[tensorboard]``): ``loggers.require`` says so before training starts.
"""

from __future__ import annotations

from typing import Any

from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.loggers.folders import library_folder

_POSITION = ("kind", "step", "epoch", "time_s")


class TensorBoardSink:
    """Scalars of metrics.jsonl records as TensorBoard events under ``<run_dir>/tensorboard``."""

    def __init__(self, paths: RunPaths) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self.log_dir = library_folder(paths.tensorboard, paths.shared)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        """The same call as ``MetricsWriter.write``."""
        if kind in ("train", "eval"):
            self._writer.add_scalar(f"{kind}/epoch", epoch, step)
            for name, value in fields.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(f"{kind}/{name}", value, step)
        else:  # start, stop, end, checkpoint: what happened, when
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
