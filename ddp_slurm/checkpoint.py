"""Compatibility home of ``load_latest``: checkpoints live in ``ddp_slurm.train.checkpoint``."""

from ddp_slurm.train.checkpoint import *  # noqa: F403
from ddp_slurm.train.checkpoint import CheckpointError, latest, load, load_latest, save  # noqa: F401
