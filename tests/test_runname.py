"""Run names for launches without run.name: shared by all ranks, kept by a requeued job, new otherwise."""

from __future__ import annotations

from datetime import datetime

from ddp_slurm.train.runname import default_name, launch_name

NOW = datetime(2026, 12, 3, 16, 58, 7)


def test_slurm_job_and_its_requeue_share_a_name() -> None:
    rank0 = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}
    rank7 = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_PROCID": "7"}
    requeued = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"}
    assert launch_name(rank0) == launch_name(rank7) == launch_name(requeued) == "job-812"
    assert launch_name({"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "2"}) == "job-812.2"  # a second srun of the job
    array = {"SLURM_JOB_ID": "815", "SLURM_ARRAY_JOB_ID": "813", "SLURM_ARRAY_TASK_ID": "2", "SLURM_STEP_ID": "0"}
    assert launch_name(array) == "job-813_2"


def test_torchrun_ranks_share_the_rendezvous_id() -> None:
    a = {"TORCHELASTIC_RUN_ID": "6f1c2a9e-8d3b-4c1e-9f00-1234", "RANK": "0"}
    b = {"TORCHELASTIC_RUN_ID": "6f1c2a9e-8d3b-4c1e-9f00-1234", "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert launch_name(a) == launch_name(b) == "torchrun-6f1c2a9e-8d3b"
    # srun torchrun: Slurm's id wins (a requeue gets a new rendezvous id but keeps the job id)
    assert launch_name({**a, "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0"}) == "job-9"


def test_a_plain_process_gets_a_new_timestamped_name() -> None:
    taken = {"20261203-165807", "20261203-165807-2"}
    assert launch_name({}) is None
    assert default_name({}, NOW, lambda n: False) == "20261203-165807"
    assert default_name({}, NOW, taken.__contains__) == "20261203-165807-3"
    assert default_name({"SLURM_JOB_ID": "4"}, NOW, lambda n: True) == "job-4"  # a job's directory resumes
