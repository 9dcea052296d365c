"""The allocation check inside real sbatch jobs of the test cluster: a script whose `--signal` is not
`slurm.signal` is refused before any work (exit 2, the fix in one line); `slurm.*` keys the job does not
have get one warning line; a matching config is silent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def submit(cluster, tmp_path: Path, name: str, sbatch_lines: list[str], check_args: list[str], sbatch_args=()) -> str:
    script = tmp_path / f"{name}.sh"
    script.write_text(
        "#!/bin/bash\n"
        + "".join(f"#SBATCH {line}\n" for line in sbatch_lines)
        + f"#SBATCH --output={tmp_path}/{name}.out\n\n"
        + f"{sys.executable} -m ddp_slurm.slurmjob.allocation {' '.join(check_args)}\n"
    )
    job = cluster.sbatch([*sbatch_args, str(script)], cwd=tmp_path)
    assert cluster.wait(job, timeout=120) in ("COMPLETED", "FAILED")
    return job


def test_allocation_check_in_real_jobs(slurm_cluster, tmp_path: Path) -> None:
    cluster = slurm_cluster
    base = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=5"]
    wrong = submit(cluster, tmp_path, "wrong", [*base, "--signal=USR1@60"], [])
    ignored = submit(cluster, tmp_path, "ignored", [*base, "--signal=USR2@120"], ["slurm.nodes=4", "slurm.time=60"])
    ok = submit(
        cluster,
        tmp_path,
        "ok",
        [*base, "--signal=USR2@120"],
        ["slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.cpus_per_task=1", "slurm.time=5", "slurm.gpus_per_node=0"],
    )

    out = (tmp_path / "wrong.out").read_text()
    assert cluster.exit_code(wrong) == (2, 0), out
    assert out.count("\n") == 1 and "--signal=USR1@60" in out and "kill every rank" in out, out
    assert "slurm.signal=USR1" in out

    out = (tmp_path / "ignored.out").read_text()
    assert cluster.exit_code(ignored) == (0, 0), out
    lines = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1, out
    assert "slurm.nodes=4 (the job has 2)" in lines[0] and "slurm.time=60 (the job has 00:05:00)" in lines[0]

    out = (tmp_path / "ok.out").read_text()
    assert cluster.exit_code(ok) == (0, 0) and out == "", out
