"""``python -m ddp_slurm.launch``: torchrun with stop-signal forwarding (see ``ddp_slurm.launch.torchrun``)."""

# First, before anything else is imported: a stop signal during start-up is recorded, not fatal.
from ddp_slurm.train.signals import StopFlag

early = StopFlag.early()

import sys  # noqa: E402

from ddp_slurm.launch.torchrun import main  # noqa: E402

sys.exit(main(early=early))
