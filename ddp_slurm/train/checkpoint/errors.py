"""The checkpoint layer's own error, raised by every format, writer and reader (one line, naming the files)."""

from __future__ import annotations

from ddp_slurm import errors


class CheckpointError(errors.Error):
    """Checkpoints exist but none can be used, or one cannot be written. One line, names the files."""
