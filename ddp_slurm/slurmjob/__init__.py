"""The Slurm job a run lives in: scontrol and requeue (``slurm``), the job's fields and signal (``jobinfo``),
settings the allocation ignores (``allocation``), nodes a run lost (``badnodes``) and a chained successor
where requeueing is refused (``chain``).

Why apart from ``distributed/`` (which rank am I, the process group, the watchdog): these talk to Slurm
about the job, not to the other ranks, and none needs torch; training, ``submit`` and the tools use them.
"""
