"""The runtime's view of the job's ranks: who each rank is (env), the process group (group), the rendezvous,
the watchdog. Talking to Slurm about the job itself lives in ``ddp_slurm.slurmjob``."""
