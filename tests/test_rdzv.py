"""The rendezvous store against a process outside the job (another user on the same node): it listens
on the rendezvous address only, and without the job's secret an outsider can neither join as a rank
nor plant keys the job reads.

Real processes: two ranks of ``python -m ddp_slurm.train`` started by hand, and an outsider that
connects to the same port with its own key file (as another user would: it cannot read ours).
"""

from __future__ import annotations

import datetime
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import base_env

from ddp_slurm.distributed import rdzv
from ddp_slurm.distributed.env import BootstrapError, DistEnv, free_port

TIMEOUT_S = 600.0
TRAIN = ["model.name=mlp", "train.max_steps=4", "train.schedule=constant", "run.name=secret", "dist.timeout_s=60"]


def env_of(rank: int, port: int, key: Path, **extra: str) -> dict[str, str]:
    return base_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        DDP_SLURM_KEY_FILE=str(key),
        **extra,
    )


def listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp{,6}) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            addr, _, hex_port = local.rpartition(":")
            if int(hex_port, 16) == port and state == "0A":  # 0A: LISTEN
                found.append(addr)
    return found


def start(cmd_env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ddp_slurm.train", *TRAIN],
        cwd=cwd,
        env=cmd_env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


# --------------------------------------------------------------------------- the secret
def test_secret_is_the_same_for_every_rank_of_a_job_and_unknown_outside(tmp_path: Path) -> None:
    key = tmp_path / "cfg" / "rendezvous.key"
    environ = {"DDP_SLURM_KEY_FILE": str(key)}
    env = DistEnv.from_environ(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "2",
        }
    )
    first = rdzv.job_secret(env, environ)
    assert first == rdzv.job_secret(env, environ) and len(first) == 32
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    other_user = {"DDP_SLURM_KEY_FILE": str(tmp_path / "other.key")}
    assert rdzv.job_secret(env, other_user) != first
    assert rdzv.job_secret(env, {"DDP_SLURM_SECRET": "x" * 40}) != first
    key.chmod(0o644)  # readable by others: no longer a secret
    with pytest.raises(BootstrapError, match="is not private.*chmod 600"):
        rdzv.job_secret(env, environ)


# --------------------------------------------------------------------------- real outsider
def test_outsider_can_neither_join_nor_plant_keys_and_the_store_listens_on_the_rendezvous_address(
    tmp_path: Path,
) -> None:
    import torch.distributed as dist

    port, key = free_port(), tmp_path / "job.key"
    rank0 = start(env_of(0, port, key), tmp_path, tmp_path / "rank0.log")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not listeners(port):
            assert rank0.poll() is None, (tmp_path / "rank0.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert listeners(port) == ["0100007F"], listeners(port)  # 127.0.0.1 only, not 0.0.0.0 or ::

        # An outsider (its own key: it cannot read ours) tries to be rank 1: it never meets rank 0.
        outsider = subprocess.run(
            [sys.executable, "-m", "ddp_slurm.train", *TRAIN[:-1], "dist.timeout_s=5"],
            cwd=tmp_path / "..",
            env=env_of(1, port, tmp_path / "outsider.key"),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert outsider.returncode == 1 and "rendezvous" in outsider.stderr and "timed out" in outsider.stderr
        # It plants what it can compute: the keys the watchdog used to read, a fake verdict.
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        for k, v in {
            "ddp_slurm/watchdog/0/hb/1": "0",
            "ddp_slurm/watchdog/0/verdict": "1",
            "ddp_slurm/watchdog/0/info/1": "evil 1",
        }.items():
            store.set(k, v)

        rank1 = start(env_of(1, port, key), tmp_path, tmp_path / "rank1.log")
        assert rank1.wait(TIMEOUT_S) == 0, (tmp_path / "rank1.log").read_text()
        assert rank0.wait(TIMEOUT_S) == 0, (tmp_path / "rank0.log").read_text()
        logs = (tmp_path / "rank0.log").read_text() + (tmp_path / "rank1.log").read_text()
        assert "lost rank" not in logs and "finished: 4 steps" in logs, logs
    finally:
        for proc in [rank0]:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)


def test_ranks_with_different_secrets_are_told_so(tmp_path: Path) -> None:
    """Two ranks of one job launched with different DDP_SLURM_SECRET values meet nobody: both give up after
    dist.timeout_s with a line naming the secret (it used to read as an unreachable rank 0)."""
    port, key = free_port(), tmp_path / "job.key"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "ddp_slurm.train", *TRAIN[:-1], "dist.timeout_s=5"],
            cwd=tmp_path,
            env=env_of(rank, port, key, DDP_SLURM_SECRET=f"secret-of-{rank}"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for rank, proc in enumerate(ranks):
        _, err = proc.communicate(timeout=TIMEOUT_S)
        errors = [line for line in err.splitlines() if " ERROR " in line]
        assert proc.returncode == 1 and len(errors) == 1, err
        assert f"rank {rank}: rendezvous at 127.0.0.1:{port} timed out after 5 s" in errors[0], errors[0]
        assert "DDP_SLURM_SECRET" in errors[0] and "Traceback" not in err, errors[0]
    assert not (tmp_path / "runs").exists()
