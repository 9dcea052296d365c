"""Checkpoints: ``<run_dir>/checkpoints/step-<N>.pt``, written atomically, sealed, found again on resume.

- ``format.py``: the file (save, load, validate, ``latest`` and the ``accept`` rules);
- ``listing.py``: the step files of the folder, and pruning to those of this run's own it keeps;
- ``fit.py``: does a whole checkpoint fit this run (optimizer, schedule, position, RNG)?
- ``seal.py``: the trailer that proves every byte of a file is the one written;
- ``snapshot.py``: host-memory copies of a state, for writes in the background;
- ``writer.py``: ``AsyncCheckpointer``, one write in flight, in a thread or a forked process;
- ``checkpointer.py``: ``Checkpointer``, the owner of the ``checkpoint`` config section (cadence,
  keep, async, urgency), the one object the training loop talks to.

The file-level functions are re-exported here (``checkpoint.save``, ``checkpoint.latest``, ...).
"""

from pathlib import Path
from typing import Any

from ddp_slurm.train.checkpoint.checkpointer import Checkpointer
from ddp_slurm.train.checkpoint.format import (
    FORMAT,
    READABLE_FORMATS,
    REQUIRED,
    SEALED_BY,
    CheckpointError,
    NoneFits,
    UnsafeCheckpoint,
    _tensors,
    all_of,
    checkpoint_dir,
    content_digest,
    file_name,
    latest,
    list_checkpoints,
    load,
    prune,
    remove_stale_temporaries,
    require,
    same_config,
    same_model,
    save,
    validate,
)
from ddp_slurm.train.checkpoint.writer import AsyncCheckpointer


def load_latest(run_dir: str | Path) -> dict[str, Any] | None:
    """The newest valid checkpoint of ``run_dir`` (``model`` without DDP's ``module.`` prefix, ``step``,
    ``epoch``, ...), or None where there is none: a single file (``format.latest``, see it for the error
    case), or for a ``dist.strategy=fsdp`` run the newest committed folder of shards gathered into one
    state (``sharded.load_latest_full``)."""
    found = latest(Path(run_dir))
    if found is None:
        from ddp_slurm.train.checkpoint import sharded

        return sharded.load_latest_full(Path(run_dir))
    return found[1]


__all__ = [
    "FORMAT",
    "READABLE_FORMATS",
    "REQUIRED",
    "SEALED_BY",
    "AsyncCheckpointer",
    "CheckpointError",
    "NoneFits",
    "Checkpointer",
    "UnsafeCheckpoint",
    "_tensors",
    "all_of",
    "checkpoint_dir",
    "content_digest",
    "file_name",
    "latest",
    "list_checkpoints",
    "load",
    "load_latest",
    "prune",
    "remove_stale_temporaries",
    "require",
    "same_config",
    "same_model",
    "save",
    "validate",
]
