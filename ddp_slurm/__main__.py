"""``python -m ddp_slurm``: the ``ddp-slurm`` command (see ``ddp_slurm.cli``)."""

from ddp_slurm.cli import run

run()
