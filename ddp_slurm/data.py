"""``python -m ddp_slurm.data``: see ``ddp_slurm.tasks.mnist.data``."""

import sys

from ddp_slurm.tasks.mnist.data import main

if __name__ == "__main__":
    sys.exit(main())
