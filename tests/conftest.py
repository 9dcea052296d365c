"""Shared fixtures: run the package's commands as real processes, the way users do."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddp_slurm.distributed.groups import NCCL_SHAPED

REPO = Path(__file__).resolve().parents[1]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def skip_or_fail(reason: str) -> None:
    """Outside CI a missing prerequisite skips with the reason; in CI it is a failure."""
    if in_ci():
        pytest.fail(f"CI=true and a prerequisite is missing: {reason}")
    pytest.skip(reason)


def base_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: no inherited launcher variables, quiet thread counts."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_"))
        and k
        not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    # Every multi-rank run of the suite meets a default group shaped like NCCL's: a collective the runtime
    # left on it with a host tensor fails here as it would on GPUs (ddp_slurm/distributed/groups.py).
    env[NCCL_SHAPED] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # test scripts run as child processes import the shared helpers (tests/helpers.py) too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def fresh_copy(dest: Path) -> Path:
    """The project's files as a clone has them (tracked and new, not ignored): no build outputs, no venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: cannot tell the project's files from build outputs")
    for name in filter(None, listed.stdout.split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def bounded_memory() -> None:
    """A child's address space capped at 4 GiB: a read of ``/dev/zero`` planted for a file fails instead of
    taking the machine (``preexec_fn``)."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def run_bounded(cwd: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m <argv>`` in ``cwd`` with a clean environment and ``bounded_memory``."""
    return subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=cwd,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=bounded_memory,
    )


@dataclass
class Launcher:
    """Runs ``python -m ddp_slurm.<module>`` or torchrun in ``cwd`` with a clean environment."""

    cwd: Path

    def cmd_train(self, *overrides: str, config: str | None = None) -> list[str]:
        cmd = [sys.executable, "-m", "ddp_slurm.train"]
        if config:
            cmd += ["--config", config]
        return cmd + list(overrides)

    def cmd_torchrun(self, nproc: int, *overrides: str, module: str = "ddp_slurm.train") -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "-m",
            module,
            *overrides,
        ]

    def run(
        self, cmd: list[str], timeout: float = 600, env: dict[str, str] | None = None, check: bool = False
    ) -> subprocess.CompletedProcess:
        res = subprocess.run(cmd, cwd=self.cwd, env=env or base_env(), capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{cmd} exited {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}")
        return res

    def popen(self, cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
        out = open(log, "w") if log else subprocess.PIPE
        return subprocess.Popen(
            cmd,
            cwd=self.cwd,
            env=env or base_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


@pytest.fixture
def launcher(tmp_path: Path) -> Launcher:
    """Processes started in a fresh working directory, so ``runs/`` lands in the test's tmp_path."""
    return Launcher(tmp_path)
