"""The successor job of a chain asks for what this job has (real `scontrol show job -o` text of the test
cluster), and its script is written into the run directory's chain/ folder, never through anything planted
there; the chain on the real cluster: tests/cluster/test_faults_cluster.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from test_allocation import JOB

from ddp_slurm.slurmjob import chain, jobinfo


def test_the_successor_asks_for_the_same_resources_and_log() -> None:
    opts = chain.resources(jobinfo.parse_job(JOB))
    assert opts == [
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=1-00:05:00",
        "--partition=debug",
        "--gpus-per-node=1",
        "--job-name=s.sh",
        "--output=/tmp/x/slurm-3.out",
        "--open-mode=append",
        "--chdir=/tmp/x",
    ]


def test_the_chain_counts_its_links(monkeypatch) -> None:
    monkeypatch.delenv(chain.ENV, raising=False)
    assert chain.links() == 0
    monkeypatch.setenv(chain.ENV, "3")
    assert chain.links() == 3


# --------------------------------------------------------------------------- chain/<job>.sh in a run directory
STUB_SCONTROL = """#!/bin/sh
echo "scontrol $*" >> "{calls}"
case "$1" in
  show) cat "{job}" ;;
  write) printf '#!/bin/bash\\nsrun python -m ddp_slurm.train\\n' > "$4" ;;
  *) exit 1 ;;
esac
"""
STUB_SBATCH = """#!/bin/sh
echo "sbatch $*" >> "{calls}"
echo 4242
"""


@pytest.fixture
def slurm_stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """scontrol and sbatch that answer as the test cluster's do (scontrol writes the script wherever the path
    leads, as the real one does); returns the file of their calls."""
    bin_dir, calls, job = tmp_path / "bin", tmp_path / "calls", tmp_path / "job.txt"
    bin_dir.mkdir()
    job.write_text(JOB + "\n")
    for name, text in (("scontrol", STUB_SCONTROL), ("sbatch", STUB_SBATCH)):
        (bin_dir / name).write_text(text.format(calls=calls, job=job))
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


@pytest.mark.parametrize("planted", ["nothing", "script-symlink", "script-fifo", "script-folder"])
def test_the_successor_script_replaces_whatever_was_planted_at_its_name(
    tmp_path: Path, slurm_stubs: Path, planted: str
) -> None:
    victim = tmp_path / "victim.sh"
    victim.write_text("a victim's file\n")
    run = tmp_path / "run"
    (run / "chain").mkdir(parents=True)
    script = run / "chain" / "41.sh"
    if planted == "script-symlink":
        script.symlink_to(victim)
    elif planted == "script-fifo":
        os.mkfifo(script)
    elif planted == "script-folder":
        script.mkdir()
    assert chain.successor("41", run, ["run.name=r"]) == "4242"
    assert victim.read_text() == "a victim's file\n"
    assert script.is_file() and not script.is_symlink() and script.read_text().startswith("#!/bin/bash\n")
    sbatch = [line for line in slurm_stubs.read_text().splitlines() if line.startswith("sbatch ")]
    assert len(sbatch) == 1 and f" {script} run.name=r" in sbatch[0], sbatch


def test_a_planted_chain_folder_is_refused_not_followed(
    tmp_path: Path, slurm_stubs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "chain").symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING):
        assert chain.successor("41", run, ["run.name=r"]) is None
    assert list(elsewhere.iterdir()) == []
    assert "could not chain a successor of job 41" in caplog.text and "symlink" in caplog.text
    assert "sbatch" not in slurm_stubs.read_text()
