"""``python -m ddp_slurm.train``: one rank of a run (see ``ddp_slurm.train.loop``)."""

# First, before torch is imported (seconds): a stop signal from here on is a clean stop, not death.
from ddp_slurm.train.signals import StopFlag

stop = StopFlag.early()

from ddp_slurm.train.loop import exit_now, main  # noqa: E402

code = main(stop=stop)
stop.close()  # main leaves a flag it was given to its caller (see signals.py on close())
exit_now(code)
