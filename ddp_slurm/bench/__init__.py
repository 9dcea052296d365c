"""``python -m ddp_slurm.bench {loader,limit,ddp,startup,tta}``: throughput and overhead, measured side by side.

Every subcommand prints a table and, with ``--json FILE``, writes the figures with the machine, torch
version, thread count and device. Stable keys: ``ratio`` (loader), ``fraction_of_limit`` (limit),
``efficiency`` (ddp), ``startup_ratio`` (startup), ``seconds_to_target`` (tta).
"""
