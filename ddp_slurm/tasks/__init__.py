"""Built-in tasks; each uses only what ddp_slurm.train.task offers a user's own task."""
