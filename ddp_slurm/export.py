"""``python -m ddp_slurm.export``: see ``ddp_slurm.tools.export``."""

import sys

from ddp_slurm.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
