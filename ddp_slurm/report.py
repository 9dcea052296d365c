"""``python -m ddp_slurm.report``: see ``ddp_slurm.tools.report``."""

import sys

from ddp_slurm.tools.report import main

if __name__ == "__main__":
    sys.exit(main())
