"""ddp_slurm: PyTorch DistributedDataParallel training on Slurm that survives preemption and resumes exactly.

Modules: bootstrap (who am I, rendezvous), config, data, models, engine (step, evaluation),
checkpoint, signals, train (the loop), submit (submitit), doctor, report, bench.
"""
__version__ = "0.1.0"
