"""The runtimes view of the job: who each rank is (env), the process group (group), the watchdog, Slurm calls."""
