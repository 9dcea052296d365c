"""Inside an sbatch job: `slurm.*` keys the allocation ignores get one warning line, a `--signal` that
training would not catch is an error with the fix. The job descriptions below are real
`scontrol show job -o` output of the Slurm 22.05 test cluster; tests/cluster/test_allocation_cluster.py
runs the same check inside real jobs."""

from __future__ import annotations

import pytest

from ddp_slurm import config
from ddp_slurm.config import ConfigError
from ddp_slurm.slurmjob.allocation import check_allocation
from ddp_slurm.slurmjob.jobinfo import allocation_values, job_signal, parse_job, parse_signal_spec, script_options

JOB = (
    "JobId=3 JobName=s.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901757 Nice=0 Account=(null) "
    "QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 "
    "ExitCode=0:0 RunTime=00:00:00 TimeLimit=1-00:05:00 TimeMin=N/A SubmitTime=2026-12-03T16:43:28 "
    "Partition=debug AllocNode:Sid=localhost:5806 ReqNodeList=(null) ExcNodeList=(null) NodeList=node[1-2] "
    "BatchHost=node1 NumNodes=2 NumCPUs=4 NumTasks=4 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=4,node=2,billing=4 "
    "Socks/Node=* NtasksPerN:B:S:C=2:0:*:* CoreSpec=* MinCPUsNode=2 MinMemoryNode=200M MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=NO Contiguous=0 Licenses=(null) Network=(null) "
    "Command=/tmp/x/s.sh WorkDir=/tmp/x StdErr=/tmp/x/slurm-3.out StdIn=/dev/null StdOut=/tmp/x/slurm-3.out "
    "Power= TresPerNode=gres:gpu:1 "
)
ENV = {
    "SLURM_JOB_ID": "3",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_GPUS_PER_NODE": "1",
    "SLURM_CPUS_PER_TASK": "1",
    "SLURM_MEM_PER_NODE": "200",
    "SLURM_JOB_PARTITION": "debug",
}


def script(signal_line: str = "#SBATCH --signal=USR2@120") -> str:
    return f"#!/bin/bash\n#SBATCH --nodes=2\n{signal_line}\n#SBATCH --time=1-00:05\n\nsrun python -m ddp_slurm.train\n"


def matching(*overrides: str) -> config.Config:
    """The config of exactly this job: no warning expected."""
    base = [
        "slurm.nodes=2",
        "slurm.tasks_per_node=2",
        "slurm.gpus_per_node=1",
        "slurm.cpus_per_task=1",
        "slurm.time=1-00:05:00",
        "slurm.mem=200M",
        "slurm.exclusive=true",
        "slurm.partition=debug",
    ]
    return config.load(None, base + list(overrides))


def test_parse_job_fields() -> None:
    fields = parse_job(JOB)
    assert fields["NumNodes"] == "2" and fields["TimeLimit"] == "1-00:05:00" and fields["Account"] == ""
    assert fields["CPUs/Task"] == "1" and fields["Power"] == "" and fields["TresPerNode"] == "gres:gpu:1"
    have = allocation_values(fields, ENV)
    assert have == {
        "nodes": 2,
        "tasks_per_node": 2,
        "gpus_per_node": 1,
        "cpus_per_task": 1,
        "partition": "debug",
        "time": 1445,
        "mem": 200,
        "exclusive": True,
    }


def test_a_matching_config_is_silent() -> None:
    assert check_allocation(matching(), ENV, JOB, script()) == []


def test_outside_slurm_nothing_is_checked() -> None:
    assert check_allocation(config.load(None, ["slurm.nodes=9", "slurm.signal=USR1"]), {}, "", None) == []


def test_ignored_keys_are_one_warning_line_naming_each() -> None:
    cfg = matching("slurm.nodes=4", "slurm.time=30", "slurm.mem=64G", "slurm.cpus_per_task=8")
    warnings = check_allocation(cfg, ENV, JOB, script())
    assert len(warnings) == 1 and "\n" not in warnings[0]
    for part in (
        "slurm.nodes=4 (the job has 2)",
        "slurm.time=30 (the job has 1-00:05:00)",
        "slurm.mem=64G (the job has 200M)",
        "slurm.cpus_per_task=8 (the job has 1)",
        "ask sbatch",
    ):
        assert part in warnings[0]


def test_a_node_count_inside_the_range_asked_for_is_silent() -> None:
    assert check_allocation(matching("slurm.nodes=1-3"), ENV, JOB, script()) == []
    [warning] = check_allocation(matching("slurm.nodes=3-4"), ENV, JOB, script())
    assert "slurm.nodes=4 (the job has 2)" in warning


def test_torchrun_agents_are_not_ranks() -> None:
    """Under `srun torchrun` a task is an agent: its task and CPU counts say nothing about ranks."""
    cfg = matching("slurm.tasks_per_node=4", "slurm.cpus_per_task=8")
    assert check_allocation(cfg, {**ENV, "TORCHELASTIC_RUN_ID": "3"}, JOB, script()) == []


def test_another_signal_is_an_error_with_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        check_allocation(matching(), ENV, JOB, script("#SBATCH --signal=USR1@90"))
    message = str(err.value)
    assert "--signal=USR1@90" in message and "slurm.signal=USR2" in message and "kill every rank" in message
    assert "slurm.signal=USR1" in message and "#SBATCH" in message
    # ... and the same signal by number or with the SIG prefix is no error
    for spec in ("12@120", "SIGUSR2@120", "R:USR2@120"):
        assert check_allocation(matching(), ENV, JOB, script(f"#SBATCH --signal={spec}")) == []


def test_batch_shell_only_signal_is_an_error() -> None:
    with pytest.raises(ConfigError, match="batch shell only"):
        check_allocation(matching(), ENV, JOB, script("#SBATCH --signal=B:USR2@120"))


def test_other_delay_and_missing_signal_warn() -> None:
    (warning,) = check_allocation(matching(), ENV, JOB, script("#SBATCH --signal=USR2@300"))
    assert "slurm.signal_delay_s=120 has no effect" in warning and "300 s before" in warning
    (warning,) = check_allocation(matching(), ENV, JOB, script("#SBATCH --comment=none"))
    assert "asked for no --signal" in warning and "#SBATCH --signal=USR2@120" in warning


def test_signal_sources_in_order() -> None:
    """The sbatch command line (SubmitLine, newer Slurm) beats SBATCH_SIGNAL, which beats the script."""
    fields = parse_job(JOB + " SubmitLine=sbatch --signal=TERM@30 s.sh train.epochs=2")
    env = {**ENV, "SBATCH_SIGNAL": "USR1@60"}
    assert job_signal(fields, env, script()).name == "TERM"
    assert job_signal(parse_job(JOB), env, script()).source == "SBATCH_SIGNAL in the environment"
    assert job_signal(parse_job(JOB), ENV, script()).source == "the script's #SBATCH line"
    assert job_signal(parse_job(JOB), ENV, None) is None


def test_script_options_stop_at_the_first_command() -> None:
    text = "#!/bin/bash\n#SBATCH --signal=USR2@120 --nodes=2\n# a comment\n\necho hi\n#SBATCH --signal=USR1\n"
    assert script_options(text) == {"signal": "USR2@120", "nodes": "2"}
    assert parse_signal_spec("USR2", "x").delay_s == 60  # Slurm's default warning time


def test_no_requeue_warns() -> None:
    (warning,) = check_allocation(matching(), ENV, JOB.replace("Requeue=1", "Requeue=0"), script())
    assert "--no-requeue" in warning
