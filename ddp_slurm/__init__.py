"""ddp_slurm: PyTorch DistributedDataParallel training on Slurm that survives preemption and resumes exactly.

Layout: dist (who am I, process group), train (the runtime: loop, step, checkpoints, signals), tasks (mnist),
launch (submit, torchrun wrapper), tools (doctor, report), bench.
"""

__version__ = "0.1.0"
