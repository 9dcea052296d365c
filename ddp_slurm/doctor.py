"""``python -m ddp_slurm.doctor``: see ``ddp_slurm.tools.doctor``."""

import sys

from ddp_slurm.tools.doctor import main

if __name__ == "__main__":
    sys.exit(main())
