"""``python -m ddp_slurm.launch``: torchrun with stop-signal forwarding (see ``ddp_slurm.launch.torchrun``)."""

import sys

from ddp_slurm.launch.torchrun import main

sys.exit(main())
