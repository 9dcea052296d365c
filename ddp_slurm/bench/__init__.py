"""``python -m ddp_slurm.bench COMMAND``: throughput, overhead and checkpoint cost, measured side by side.

Every subcommand prints a table and, with ``--json FILE``, writes the figures with the machine, torch
version, thread count and device. Stable keys: ``ratio`` (loader), ``fraction_of_limit`` (limit),
``efficiency`` (ddp), ``startup_ratio`` (startup), ``seconds_to_target`` (tta), ``stall_ratio`` (checkpoint), ``ratio`` (overhead),
``fsdp_over_ddp`` (memory), ``ratio`` (shards).
"""
