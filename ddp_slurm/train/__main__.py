"""``python -m ddp_slurm.train``: one rank of a run (see ``ddp_slurm.train.cli`` and ``ddp_slurm.train.loop``)."""

import sys

from ddp_slurm.train.cli import main

sys.exit(main())
