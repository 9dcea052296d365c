"""``python -m ddp_slurm.train``: one rank of a run (see ``ddp_slurm.train.cli`` and ``ddp_slurm.train.loop``)."""

import sys

# First, before torch is imported (seconds): a stop signal from here on is a clean stop, not death.
from ddp_slurm.train.signals import StopFlag

stop = StopFlag.early()

from ddp_slurm.train.cli import main  # noqa: E402

sys.exit(main(stop=stop))  # leaves through exitcodes.exit_now once training has run
