"""``python -m ddp_slurm.submit`` without Slurm: the sbatch script it would submit, submitit's local
executor running real ranks, sweeps, failures reported with training's status, and bad options.

The same command on the real cluster (requeue on a signal, 4 nodes, a job array) is tested in
tests/cluster/test_submit_cluster.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from conftest import Launcher, base_env

from ddp_slurm import config
from ddp_slurm.config import ConfigError

SUBMIT = [sys.executable, "-m", "ddp_slurm.submit"]
TINY = ["model.name=mlp", "train.epochs=1", "train.max_steps=20", "train.log_every_steps=5"]


def sbatch_lines(script: str) -> dict[str, str]:
    """``#SBATCH --key=value`` lines as {key: value} (a bare flag maps to "")."""
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --") :].partition("=")
            out[key] = value.strip("'")
    return out


def one_line_error(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("python -m ddp_slurm.submit: error: "), res.stderr
    return lines[0]


def test_dry_run_prints_the_sbatch_script_for_the_flags(launcher: Launcher) -> None:
    res = launcher.run(
        SUBMIT
        + [
            "--dry-run",
            "--nodes",
            "3",
            "--gpus-per-node",
            "2",
            "--time",
            "30",
            "--partition",
            "gpu",
            "--signal-delay",
            "90",
            "--cpus-per-task",
            "4",
            "--account",
            "proj",
            "--name",
            "dry",
            "train.global_batch_size=120",
        ],
        check=True,
    )
    script = res.stdout
    assert script.startswith("#!/bin/bash\n")
    flags = sbatch_lines(script)
    assert flags["nodes"] == "3"
    assert flags["gpus-per-node"] == "2"
    assert flags["ntasks-per-node"] == "2"  # one rank per GPU by default
    assert flags["cpus-per-task"] == "4"
    assert flags["time"] == "30"
    assert flags["partition"] == "gpu"
    assert flags["account"] == "proj"
    assert flags["signal"] == "USR2@90"
    assert "requeue" in flags and "qos" not in flags and "array" not in flags
    assert flags["job-name"] == "dry"
    folder = launcher.cwd / "runs" / "dry" / "submitit" / "%j"
    assert flags["output"] == str(folder / "%j_0_log.out")
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and f"{sys.executable} -u -m submitit.core._submit {folder}" in srun[0]
    assert " --kill-on-bad-exit=1 " in srun[0], srun[0]  # a failed rank ends the step: no rank holds the job
    assert not (launcher.cwd / "runs").exists(), "a dry run must not create the run directory"


def test_dry_run_says_the_training_command_world_size_resources_and_config(launcher: Launcher) -> None:
    """submitit's script shows only a pickle being run: the summary on stderr says what each rank trains."""
    res = launcher.run(SUBMIT + ["--dry-run", "--nodes", "4", "--name", "four", "train.lr=1e-3"], check=True)
    said = res.stderr
    assert "# world size: 4 (4 node(s) x 1 rank(s) per node)" in said
    assert "no GPU (slurm.gpus_per_node=0: a CPU job)" in said and "time 01:00:00" in said
    root = launcher.cwd / "runs"
    assert f'#   python -m ddp_slurm.train train.lr=1e-3 slurm.nodes=4 run.name="four" run.output_root="{root}"' in said
    block = said.partition("# config (written to the run directory's config.yaml):\n")[2].partition("# the sbatch")[0]
    shown = yaml.safe_load("\n".join(line[4:] for line in block.splitlines()))
    assert shown["train"]["lr"] == 1e-3 and shown["slurm"]["nodes"] == 4 and shown["run"]["output_root"] == str(root)
    assert res.stdout.startswith("#!/bin/bash\n") and "world size" not in res.stdout  # stdout: the script alone


def test_dry_run_takes_defaults_from_the_config_and_flags_win(launcher: Launcher) -> None:
    cfg = launcher.cwd / "job.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "fromfile"},
                "slurm": {
                    "nodes": 2,
                    "gpus_per_node": 4,
                    "tasks_per_node": 2,
                    "partition": "a100",
                    "qos": "low",
                    "time_min": 600,
                    "signal": "USR1",
                    "signal_delay_s": 300,
                    "requeue": False,
                },
            }
        )
    )
    res = launcher.run(SUBMIT + ["--dry-run", "--config", str(cfg), "--nodes", "4", "--qos", "high"], check=True)
    flags = sbatch_lines(res.stdout)
    assert (flags["nodes"], flags["qos"]) == ("4", "high")  # flags win
    assert (flags["gpus-per-node"], flags["ntasks-per-node"]) == ("4", "2")
    assert (flags["partition"], flags["time"]) == ("a100", "600")
    assert flags["signal"] == "USR1@300"
    assert "no-requeue" in flags and "requeue" not in flags
    assert flags["job-name"] == "fromfile"


def test_a_node_range_is_sbatchs_own_and_recorded_as_two_keys(launcher: Launcher) -> None:
    """``--nodes 2-4``: Slurm may start the job on 2, 3 or 4 nodes; each keeps the global batch of 96 with
    micro-batches of 8 (6, 4 or 3 of them per step), so it is submitted; the config records the range."""
    res = launcher.run(
        SUBMIT + ["--dry-run", "--nodes", "2-4", "train.global_batch_size=96", "train.micro_batch_size=8"]
    )
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --nodes=2-4\n" in res.stdout
    assert "# world size: 2-4 (2-4 node(s) x 1 rank(s) per node)" in res.stderr
    assert "#     nodes: 4\n#     min_nodes: 2\n" in res.stderr


def test_a_submit_job_keeps_its_allocation_and_runs_submitits_srun_through_the_supervisor(launcher: Launcher) -> None:
    """``--no-kill`` and ``srun`` defined, after the user's ``--setup`` lines, as a shell function calling the
    supervisor with the training's arguments; ``slurm.restarts=0`` and a sweep keep submitit's plain srun."""
    res = launcher.run(SUBMIT + ["--dry-run", "--nodes", "2", "--setup", "module load x", "train.lr=1e-3"], check=True)
    lines = res.stdout.splitlines()
    assert "#SBATCH --no-kill" in lines
    [line] = [x for x in lines if x.startswith("srun() {")]
    # the line before it says what it does (a reader of the script meets a shell function named srun)
    assert lines[lines.index(line) - 1].startswith("# srun below runs through ddp_slurm's supervisor: it relaunches")
    assert (
        lines.index("module load x") < lines.index(line) < [i for i, x in enumerate(lines) if x.startswith("srun ")][0]
    )
    words = shlex.split(line)
    assert words[3:6] == ["-m", "ddp_slurm.launch.supervise", "--submitit"] and words[7:] == ["--", "$@;", "}"]
    assert shlex.split(words[6])[:2] == ["train.lr=1e-3", "slurm.nodes=2"]
    for plain in (["slurm.restarts=0"], ["--sweep", "train.lr=1e-3,1e-2"]):
        text = launcher.run(SUBMIT + ["--dry-run", "--nodes", "2", *plain], check=True).stdout
        assert "--no-kill" not in text and "srun() {" not in text, plain


def test_resource_flags_are_made_from_the_slurm_sections_fields() -> None:
    """One declaration per key: each slurm.* field is a flag (its docstring the help, its check the check),
    with the spellings users have; requeue (on by default) and requeue_mode (submit jobs never chain) are not, nor
    the keys of the batch script's relaunch and of naming slow nodes."""
    from ddp_slurm.config import SlurmConfig
    from ddp_slurm.launch import flags, submit

    spelled = {s: a for a in submit.build_parser()._actions for s in a.option_strings}
    for name in ("-N", "--nodes", "--tasks-per-node", "--ntasks-per-node", "--signal-delay", "--time", "--exclusive"):
        assert name in spelled, name
    fields = {f.name for f in dataclasses.fields(SlurmConfig)}
    # keys of the supervisor and the runtime's slow-node judgement: KEY=VALUE, not submit flags; min_nodes is
    # the MIN of --nodes MIN-MAX
    own = {"restarts", "spare_nodes", "slow_factor", "slow_windows", "exclude_slow", "min_nodes"}
    assert {f.dest for f in flags.FLAGS} == fields - {"requeue", "requeue_mode"} - own
    for flag in flags.FLAGS:
        assert spelled[flag.spellings[0]].help == flag.help and flag.help.endswith(f"(slurm.{flag.dest})")
    assert "one per GPU" in spelled["--tasks-per-node"].help  # the field's docstring
    for sbatch_option in ("nodes", "ntasks_per_node", "gpus_per_node", "time", "mem_per_gpu", "exclusive", "signal"):
        assert sbatch_option in flags.OWN_OPTIONS, sbatch_option
    with pytest.raises(ConfigError, match=r"slurm.cpus_per_task in the command line: expected an integer >= 1, got 0"):
        config.load(None, ["slurm.cpus_per_task=0"])  # the flag's message above is this one's


def test_a_submission_reads_its_config_once_and_imports_its_task_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """make_plan reads the config once and derives each run's from it; the task is resolved once for a real
    submission and never for a dry run (counted by wrapping the two functions, which still do their work)."""
    from ddp_slurm.config import schema
    from ddp_slurm.launch import plan, preview, submit

    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text("model:\n  name: mlp\n")
    counts = {"load": 0, "task": 0}
    real_load, real_task_class = config.load, schema.task_class

    def load(*args, **kwargs):
        counts["load"] += 1
        return real_load(*args, **kwargs)

    def task_class(spec):
        counts["task"] += 1
        return real_task_class(spec)

    monkeypatch.setattr(config, "load", load)
    monkeypatch.setattr(schema, "task_class", task_class)
    argv = ["--cluster", "local", "--config", "job.yaml", "--sweep", "train.lr=1e-3,2e-3,3e-3", "model.name=cnn"]
    made = plan.make_plan(submit.build_parser().parse_intermixed_args(argv))
    assert [r.cfg.train.lr for r in made.runs] == [1e-3, 2e-3, 3e-3]
    assert all(r.cfg.resolved and r.cfg.model.name == "cnn" for r in made.runs)
    assert counts == {"load": 1, "task": 1}
    counts.update(load=0, task=0)
    dry = plan.make_plan(submit.build_parser().parse_intermixed_args(["--dry-run", "--config", "job.yaml"]))
    assert "model:\n#     name: mlp" in preview.summary(dry)
    assert counts == {"load": 1, "task": 0}


def test_dry_run_of_a_sweep_is_a_job_array(launcher: Launcher) -> None:
    res = launcher.run(SUBMIT + ["--dry-run", "--name", "sw", "--sweep", "train.lr=1e-3,3e-3,1e-2"], check=True)
    flags = sbatch_lines(res.stdout)
    assert flags["array"] == "0-2%3"
    assert flags["output"] == str(launcher.cwd / "runs" / "sw" / "submitit" / "%A_%a" / "%A_%a_0_log.out")
    assert not (launcher.cwd / "runs").exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--nodes", "0"], "--nodes: expected an integer >= 1"),
        (["--nodes", "two"], "--nodes: expected an integer"),
        (["--cpus-per-task", "0"], "argument --cpus-per-task: expected an integer >= 1, got 0"),
        (["--signal", "KILL"], "argument --signal: expected one of 'USR1', 'USR2'"),
        (["--max-requeues", "-1"], "argument --max-requeues: expected an integer >= 0, got -1"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--cluster", "mars"], "argument --cluster: invalid choice"),
        (["--cluster", "local", "--nodes", "2"], "--nodes 2 needs Slurm"),
        (["--cluster", "debug", "--tasks-per-node", "2"], "--cluster debug runs one task"),
        (["--cluster", "local", "--dry-run"], "--dry-run prints the sbatch script of a Slurm job"),
        (["train.lr=-1"], "train.lr"),
        (["train.lrr=1"], "unknown config key 'train.lrr'"),
        (["notakey"], "bad override 'notakey'"),
        (["--name", "a/b"], "run.name"),
        (["--config", "missing.yaml"], "missing.yaml not found"),
        (["--nodes", "3"], "not divisible by the world size 3"),
        (["--nodes", "4-2"], "expected MIN-MAX with 1 <= MIN <= MAX, got '4-2'"),
        (["--nodes", "2-4", "train.global_batch_size=96"], "set train.micro_batch_size=8"),
        (
            ["--nodes", "2-4", "train.global_batch_size=96", "train.micro_batch_size=16"],
            "on 4 node(s) x 1 task(s), one of --nodes 2-4: make it a multiple of 192",
        ),
        (["--sweep", "train.lr"], "bad --sweep 'train.lr'"),
        (["--sweep", "slurm.nodes=1,2"], "--sweep cannot vary slurm.nodes"),
        (["--sweep", "train.lr=1e-3,-1"], "train.lr"),
        (["--summary", "nowhere"], "neither a sweep directory"),
    ],
)
def test_bad_options_fail_with_one_line_and_submit_nothing(launcher: Launcher, args: list[str], says: str) -> None:
    res = launcher.run(
        SUBMIT + ["--dry-run" if "--cluster" not in args and "--summary" not in args else "--wait", *args]
    )
    assert says in one_line_error(res)
    assert res.stdout == ""
    assert not (launcher.cwd / "runs").exists()


def test_cluster_slurm_without_sbatch_is_a_clear_error(launcher: Launcher, tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    res = launcher.run(SUBMIT + ["--cluster", "slurm", *TINY], env=base_env(PATH=str(empty)))
    assert "sbatch and srun not found on PATH" in one_line_error(res)
    assert not (launcher.cwd / "runs").exists()


def test_local_executor_runs_two_ranks_to_the_end(launcher: Launcher) -> None:
    res = launcher.run(SUBMIT + ["--cluster", "local", "--tasks-per-node", "2", "--wait", "--name", "loc", *TINY])
    assert res.returncode == 0, res.stdout + res.stderr
    run = launcher.cwd / "runs" / "loc"
    job_id = re.search(r"^job: (\d+) \(local: 1 node\(s\) x 2 task\(s\)\)$", res.stdout, re.M)[1]
    assert f"run directory: {run}\n" in res.stdout
    log0 = run / "submitit" / job_id / f"{job_id}_0_log.out"
    assert f"log of rank 0: {log0}\n" in res.stdout
    assert "starting run" in res.stdout and "world size 2" in res.stdout  # rank 0's log, streamed
    assert re.search(r"^finished: 20 steps, final test accuracy \d+\.\d\d%; run directory ", res.stdout, re.M)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    start = rows[0]
    assert (start["kind"], start["world_size"], start["launcher"]) == ("start", 2, "torchrun")
    assert rows[-1]["kind"] == "end" and rows[-1]["step"] == 20
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["slurm"]["tasks_per_node"] == 2  # the flag is recorded as a config override
    assert {p.name for p in log0.parent.glob("*_result.pkl")} == {f"{job_id}_0_result.pkl", f"{job_id}_1_result.pkl"}

    # The same name with a different config is refused before anything is submitted.
    again = launcher.run(SUBMIT + ["--cluster", "local", "--name", "loc", *TINY[:-1], "train.lr=0.1"])
    assert "holds a run with another config (train.lr" in one_line_error(again)
    # (submitit's local controller also leaves an empty folder literally named "%j")
    assert [p.name for p in (run / "submitit").iterdir() if p.name != "%j"] == [job_id]


def test_wait_exits_with_trainings_status_and_the_failing_ranks_lines(launcher: Launcher) -> None:
    # fp16 under fsdp passes the config checks but training refuses it once running: exit 2 inside the job.
    bad = [*TINY, "train.precision=fp16", "dist.strategy=fsdp"]
    res = launcher.run(SUBMIT + ["--cluster", "local", "--wait", "--name", "bad", *bad])
    assert res.returncode == 2, res.stdout + res.stderr
    assert (
        "rank 0 failed: training exited 2 on rank 0 (usage or config error): "
        "train.precision=fp16 runs under dist.strategy=ddp, not fsdp" in res.stderr
    )
    assert "--- last lines of the failing rank's log" in res.stdout


def test_local_sweep_makes_one_run_per_value_and_a_summary(launcher: Launcher) -> None:
    res = launcher.run(
        SUBMIT + ["--cluster", "local", "--wait", "--name", "lrs", "--sweep", "train.lr=1e-3,1e-2", *TINY]
    )
    assert res.returncode == 0, res.stdout + res.stderr
    root = launcher.cwd / "runs" / "lrs"
    assert sorted(p.name for p in root.iterdir() if (p / "config.yaml").exists()) == ["lr=1e-2", "lr=1e-3"]
    for name, lr in (("lr=1e-3", 1e-3), ("lr=1e-2", 1e-2)):
        saved = yaml.safe_load((root / name / "config.yaml").read_text())
        assert saved["train"]["lr"] == lr and saved["run"]["name"] == name
    manifest = json.loads((root / "sweep.json").read_text())
    assert [r["overrides"] for r in manifest["runs"]] == [["train.lr=1e-3"], ["train.lr=1e-2"]]

    summary = launcher.run(SUBMIT + ["--summary", str(root)], check=True).stdout
    rows = [line.split() for line in summary.splitlines()[2:]]
    assert sorted(r[:4] for r in rows) == [["lr=1e-2", "1e-2", "finished", "20"], ["lr=1e-3", "1e-3", "finished", "20"]]
    for r in rows:
        assert re.fullmatch(r"\d+\.\d\d%", r[4]), summary
    assert "best first by test accuracy (higher is better)" in summary.splitlines()[0], summary
    best = [float(r[5].rstrip("%")) for r in rows]
    assert best == sorted(best, reverse=True), summary  # ranked: the best accuracy first
    assert summary in res.stdout  # --wait ends with the same table


def test_dry_run_warns_of_misfits_one_line_each_before_a_user_queues(launcher: Launcher) -> None:
    """16 GPUs at 4 samples each, a Dataset task's loader workers on too few CPUs, no partition, account or
    memory: one ``# warning:`` line each on stderr; a job that fits gets none."""

    def warned(*args: str) -> list[str]:
        res = launcher.run(SUBMIT + ["--dry-run", *args], check=True)
        assert "warning" not in res.stdout  # stdout: the script alone
        return [line for line in res.stderr.splitlines() if line.startswith("# warning:")]

    small = warned("--nodes", "4", "--gpus-per-node", "4", "train.global_batch_size=64")
    assert any("16 GPU ranks share train.global_batch_size=64: 4 samples per GPU per step" in w for w in small), small
    assert any("raise train.global_batch_size to 256 or more" in w for w in small)
    for key in ("partition", "account", "mem"):
        assert sum(f"no slurm.{key} set" in w for w in small) == 1, small
    (launcher.cwd / "line_task.py").write_text("")  # a dry run imports no task: the name is enough
    cpus = warned("--nodes", "1", "--cpus-per-task", "2", "task=line_task.py:Line", "train.workers=2")
    assert any("slurm.cpus_per_task=2 per rank" in w and "--cpus-per-task 3 or more" in w for w in cpus), cpus
    fits = ["--partition", "gpu", "--account", "lab", "--mem", "64G", "--gpus-per-node", "4"]
    assert warned("--nodes", "2", *fits, "--cpus-per-task", "8", "train.global_batch_size=512") == []
    mnist = warned("--nodes", "1", *fits, "--cpus-per-task", "2", "train.global_batch_size=512")
    assert mnist == []  # the built-in task keeps its data in memory: no loader workers to feed
