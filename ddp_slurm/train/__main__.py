"""``python -m ddp_slurm.train``: one rank of a run (see ``ddp_slurm.train.entry``)."""

from ddp_slurm.train.entry import exit_now, main

exit_now(main())
