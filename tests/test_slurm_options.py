"""Slurm escape hatches of `submit` and the sbatch scripts: Slurm time formats, memory, whole nodes,
`-N`/`--ntasks-per-node`, `--sbatch KEY=VALUE` pass-through and `--setup LINE`, checked in the exact
sbatch script submitit would submit (`--dry-run`, built by submitit's own code)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, base_env

from ddp_slurm import config, slurm_time
from ddp_slurm.config import ConfigError


@pytest.mark.parametrize(
    ("text", "minutes"),
    [
        ("90", 90),
        ("5:30", 6),  # MM:SS, seconds round up
        ("01:00:00", 60),
        ("1:30:00", 90),
        ("2-00", 2880),
        ("1-02:30", 1590),
        ("1-00:00:01", 1441),
        ("UNLIMITED", None),
        ("infinite", None),
    ],
)
def test_slurm_time_formats(text: str, minutes: int | None) -> None:
    assert slurm_time.minutes(text) == minutes
    if minutes is not None:
        assert slurm_time.minutes(slurm_time.format_minutes(minutes)) == minutes


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "0", "00:00:00", "-5", "1-", "a-01:00"])
def test_bad_slurm_times(text: str) -> None:
    with pytest.raises(ValueError, match="MM, MM:SS, HH:MM:SS"):
        slurm_time.minutes(text)


def test_config_time_spellings(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("slurm:\n  time: 1:30:00\n")  # YAML 1.1 would read this as the integer 5400
    assert config.load(f).slurm.time == "1:30:00"
    f.write_text("slurm:\n  time: 90\n")  # a bare number: minutes, as sbatch reads it
    assert config.load(f).slurm.time == "90"
    f.write_text("slurm:\n  time_min: 45\n")  # the old key still means minutes
    assert config.load(f).slurm.time == "45"
    assert config.load(None, ["slurm.time=2-00:00:00"]).slurm.time == "2-00:00:00"
    assert config.load(None, ["slurm.time_min=30"]).slurm.time == "30"
    with pytest.raises(ConfigError, match=r"slurm\.time .*expected a Slurm time .*got '1h'"):
        config.load(None, ["slurm.time=1h"])
    with pytest.raises(ConfigError, match=r"slurm\.mem .*size like 64G"):
        config.load(None, ["slurm.mem=lots"])


def dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_slurm.submit", "--dry-run", *args],
        cwd=tmp_path,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def sbatch_lines(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M))


def test_submit_resources_reach_the_sbatch_script(tmp_path: Path) -> None:
    res = dry_run(
        tmp_path,
        "-N",
        "2",
        "--ntasks-per-node",
        "2",
        "--time",
        "1-02:30",
        "--mem",
        "64G",
        "--mem-per-gpu",
        "16G",
        "--exclusive",
        "--sbatch",
        "mail-type=END",
        "--sbatch=--hint=nomultithread",  # an option-looking value needs the = form (argparse)
        "--sbatch",
        "spread-job",
        "--setup",
        "module load cuda/12.4",
        "--setup",
        "export NCCL_DEBUG=WARN",
        "train.global_batch_size=64",
    )
    assert res.returncode == 0, res.stderr
    lines = sbatch_lines(res.stdout)
    assert lines["nodes"] == "2" and lines["ntasks-per-node"] == "2"
    assert lines["time"] == "1590"  # submitit writes minutes
    assert lines["mem"] == "64G" and lines["mem-per-gpu"] == "16G" and "exclusive" in lines
    assert lines["mail-type"] == "END" and lines["hint"] == "nomultithread" and "spread-job" in lines
    assert lines["signal"] == "USR2@120" and "requeue" in lines
    setup = res.stdout.index("module load cuda/12.4")
    assert setup < res.stdout.index("export NCCL_DEBUG=WARN") < res.stdout.index("srun ")
    assert list(tmp_path.iterdir()) == []  # a dry run creates nothing


def test_submit_time_in_hours_and_default(tmp_path: Path) -> None:
    assert sbatch_lines(dry_run(tmp_path, "--time", "01:00:00").stdout)["time"] == "60"
    assert sbatch_lines(dry_run(tmp_path).stdout)["time"] == "60"


@pytest.mark.parametrize(
    ("args", "must_say"),
    [
        (["--sbatch", "time=10"], "use --time instead"),
        (["--sbatch", "signal=USR1@60"], "slurm.signal"),
        (["--sbatch", "mail-type="], "no value after '='"),
        (["--sbatch", "=x"], "expected KEY=VALUE"),
        (["--time", "1h"], "argument --time: '1h' is not a Slurm time"),
        (["--time", "UNLIMITED"], "give a finite --time"),
        (["--mem", "many"], "size like 64G"),
    ],
)
def test_submit_bad_escape_hatches(tmp_path: Path, args: list[str], must_say: str) -> None:
    res = dry_run(tmp_path, *args)
    assert res.returncode == 2, res
    assert res.stderr.count("\n") == 1 and must_say in res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", ["mnist_4node.sh", "mnist_torchrun.sh"])
def test_sbatch_scripts_carry_commented_escape_hatches(script: str) -> None:
    text = (REPO / "sbatch" / script).read_text()
    for line in ("##SBATCH --mem=", "##SBATCH --exclusive", "# module load "):
        assert line in text, f"{script} lacks a commented {line!r} line"
    assert subprocess.run(["bash", "-n", str(REPO / "sbatch" / script)]).returncode == 0
