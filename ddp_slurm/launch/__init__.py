"""Launchers: submitit (submit), torchrun's signal-forwarding wrapper (python -m ddp_slurm.launch). No torch at import."""
