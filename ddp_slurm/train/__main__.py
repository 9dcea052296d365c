"""``python -m ddp_slurm.train``: one rank of a run (see ``ddp_slurm.train.loop``)."""

from ddp_slurm.train.loop import exit_now, main

exit_now(main())
