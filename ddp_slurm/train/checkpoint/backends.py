"""A checkpoint backend is two halves (``ondisk.py``: how a checkpoint lies on disk; ``capture.py``: how the model
and optimizer state is captured and put back), behind one interface the gate and the checkpointer use. A third
backend implements one half and pairs it with an existing one.

- ``WholeFile``: ``checkpoints/step-<N>.pt``, rank 0's whole state in one sealed file (``dist.strategy=ddp``);
- ``Sharded``: ``checkpoints/step-<N>/``, every rank's shards and a sealed commit record (``dist.strategy=fsdp``).

Everything a backend does not decide (trust, the record's shape, being this run's, fitting) is the gate's
(``gate.py``), for every backend: that is how a rule the file format keeps is kept by the folder too.
"""

from __future__ import annotations

from pathlib import Path

from ddp_slurm.train.checkpoint.capture import Capture, Objects, RankZeroCapture, ShardedCapture
from ddp_slurm.train.checkpoint.ondisk import OnDisk, Shape, ShardedDisk, WholeFileDisk

__all__ = ["BACKENDS", "Backend", "Objects", "Shape", "Sharded", "WholeFile", "backend_at"]


class Backend(OnDisk, Capture):
    """One on-disk half and one capture half (see the module docstring)."""


class WholeFile(WholeFileDisk, RankZeroCapture, Backend):
    pass


class Sharded(ShardedDisk, ShardedCapture, Backend):
    pass


BACKENDS: tuple[Backend, ...] = (WholeFile(), Sharded())


def backend_at(path: Path) -> Backend:
    """The backend of one checkpoint named by its path: the one whose on-disk half says it holds it. ValueError
    when none does (not a ``step-<N>.pt`` file nor a folder with a commit record)."""
    for backend in BACKENDS:
        if backend.holds(path):
            return backend
    raise ValueError(f"{path} is neither a checkpoint file (*.pt) nor a folder of shards (with {'commit.pt'})")
