"""``python -m ddp_slurm.submit``: see ``ddp_slurm.launch.submit``."""

import sys

from ddp_slurm.launch.submit import main

if __name__ == "__main__":
    sys.exit(main())
