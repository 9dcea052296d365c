"""Checkpoints: written atomically and sealed, found again through one gate, restored exactly.

- ``checkpointer.py``: ``Checkpointer``, the one object the training loop asks (restore, due, save,
  wait), the owner of the ``checkpoint`` config section;
- ``gate.py``: the rules every checkpoint passes before it is used (trusted, whole, well formed, this
  run's, fits), for every backend and reader;
- ``backends.py``: the two ways a checkpoint lies on disk (a whole file, a folder of shards) behind one
  interface, each an on-disk half (``ondisk.py``) and a capture half (``capture.py``); ``wholefile.py`` /
  ``listing.py`` and ``sharded.py`` are their file formats; ``errors.py``: ``CheckpointError``;
- ``parts.py``: what a checkpoint holds besides the model and optimizer, as registered parts (a hook, the task
  or a batch source may add one); ``standard.py``: the parts every run has; ``state.py``: the position;
- ``schema.py``: the record's shape; ``fit.py``: does it fit this run's optimizer and schedule;
- ``seal.py``: the trailer that proves every byte is the one written; ``dcp_safe.py``: torch's
  distributed checkpoints read without unpickling code;
- ``snapshot.py``, ``wholefile_writer.py``, ``sharded_writer.py``: writing in the background.

The whole-file functions are re-exported here (``checkpoint.save``, ``checkpoint.load``, ...).
"""

from pathlib import Path
from typing import Any

from ddp_slurm.train.checkpoint.checkpointer import Checkpointer, NonFiniteWeights
from ddp_slurm.train.checkpoint.errors import CheckpointError
from ddp_slurm.train.checkpoint.gate import (
    NoneFits,
    UnsafeCheckpoint,
    all_of,
    backend_of,
    latest,
    require,
    same_config,
    same_model,
)
from ddp_slurm.train.checkpoint.listing import checkpoint_dir, list_checkpoints
from ddp_slurm.train.checkpoint.wholefile import (
    FORMAT,
    READABLE_FORMATS,
    REQUIRED,
    SEALED_BY,
    _tensors,
    content_digest,
    file_name,
    load,
    remove_stale_temporaries,
    save,
    validate,
)
from ddp_slurm.train.checkpoint.wholefile_writer import AsyncCheckpointer


def load_latest(run_dir: str | Path) -> dict[str, Any] | None:
    """The newest valid checkpoint of ``run_dir`` as one state on this process (``model`` without DDP's
    ``module.`` prefix, ``step``, ``epoch``, ...), whichever strategy wrote it (a folder of shards is
    gathered), or None where there is none. It passes the gate first (trusted, whole, in place)."""
    from ddp_slurm.runpaths import RunPaths

    found = latest(Path(run_dir))
    if found is None:
        return None
    return backend_of(RunPaths(Path(run_dir))).load_whole(*found)


__all__ = [
    "FORMAT",
    "READABLE_FORMATS",
    "REQUIRED",
    "SEALED_BY",
    "AsyncCheckpointer",
    "CheckpointError",
    "Checkpointer",
    "NonFiniteWeights",
    "NoneFits",
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
    "remove_stale_temporaries",
    "require",
    "same_config",
    "same_model",
    "save",
    "validate",
]
