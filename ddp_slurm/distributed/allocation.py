"""``python -m ddp_slurm.distributed.allocation``: the allocation check's former module path, kept so that a job
script naming it keeps working (the check lives in ``ddp_slurm.slurmjob.allocation``)."""

import sys

from ddp_slurm.slurmjob.allocation import main

if __name__ == "__main__":
    sys.exit(main())
