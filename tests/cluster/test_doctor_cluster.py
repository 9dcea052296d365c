"""`srun python -m ddp_slurm.doctor` on the real multi-node test cluster: OK, and faults that must each
end in a clear per-rank verdict and a non-zero exit instead of a hang."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

PY = str(Path(sys.executable).absolute())  # the venv's python: the nodes share this filesystem
DOCTOR = [PY, "-m", "ddp_slurm.doctor", "--timeout", "10", "--size-mb", "4", "--iters", "2"]
SRUN_TIMEOUT = 600  # queueing behind other jobs and importing torch on shared cores; a hang still fails


def srun(cluster, tmp_path: Path, nodes: str, *command: str, env: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """srun one task per node on exactly ``nodes`` (rank 0 on the first), output labelled by task."""
    n = len(nodes.split(","))
    return cluster.run(
        [
            "srun",
            f"-N{n}",
            f"-n{n}",
            f"--nodelist={nodes}",
            "--label",
            "--kill-on-bad-exit=0",
            "env",
            "OMP_NUM_THREADS=1",
            *env,
            *command,
        ],
        cwd=tmp_path,
        timeout=SRUN_TIMEOUT,
    )


def verdicts(stdout: str) -> dict[int, str]:
    """task id -> its FAIL line (srun --label prefixes every line with 'TASK: ')."""
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"\s*(\d+): doctor: FAIL (.*)", line)
        if m:
            found.setdefault(int(m[1]), m[2])
    return found


def test_doctor_ok_on_four_nodes(slurm_cluster, tmp_path):
    cp = slurm_cluster.run(
        ["srun", "-N4", "-n4", "env", "OMP_NUM_THREADS=1", *DOCTOR], cwd=tmp_path, timeout=SRUN_TIMEOUT
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "doctor: verdict OK" in cp.stdout
    assert "4 rank(s) on 4 host(s), launcher slurm" in cp.stdout
    rows = [line.split() for line in cp.stdout.splitlines() if re.match(r"\d+\s+0/1\s+\d/4\s", line)]
    assert sorted(int(r[0]) for r in rows) == [0, 1, 2, 3], cp.stdout
    hosts = {r[3] for r in rows}
    assert hosts == set(slurm_cluster.nodes), cp.stdout
    for r in rows:  # each rank uses its node's own, non-loopback address on the cluster network
        assert r[7] == slurm_cluster.addresses[r[3]] and r[8] == "no", r


def test_doctor_unresolvable_master_addr(slurm_cluster, tmp_path):
    cp = srun(slurm_cluster, tmp_path, "node1,node2", *DOCTOR, env=("MASTER_ADDR=nosuchnode.invalid",))
    assert cp.returncode != 0
    lines = verdicts(cp.stdout)
    assert set(lines) == {0, 1}, cp.stdout + cp.stderr
    assert all("unresolvable host" in line and "nosuchnode.invalid" in line for line in lines.values()), lines


def test_doctor_master_addr_on_the_wrong_node(slurm_cluster, tmp_path):
    cp = srun(slurm_cluster, tmp_path, "node1,node2", *DOCTOR, env=("MASTER_ADDR=node3",))
    assert cp.returncode != 0
    lines = verdicts(cp.stdout)
    assert set(lines) == {0, 1}, cp.stdout + cp.stderr
    assert "wrong MASTER_ADDR" in lines[0] and "node1" in lines[0], lines
    assert "rank 0 unreachable" in lines[1] and "node3" in lines[1], lines


def _take_port(cluster, node: str) -> tuple[subprocess.Popen, int]:
    """A program on ``node`` listening on a port (not a rendezvous); returns (process, port)."""
    pid = (cluster.state_dir / "run" / f"slurmd-{node}.pid").read_text().split()[0]
    code = (
        "import socket, sys, random, time\n"
        "for port in random.sample(range(30000, 32000), 50):\n"
        "    try:\n        s = socket.create_server(('', port))\n        break\n"
        "    except OSError:\n        continue\n"
        "print(port, flush=True)\ntime.sleep(900)\n"
    )
    proc = subprocess.Popen(
        ["nsenter", "-t", pid, "--net", "--uts", "--", PY, "-c", code],
        env=cluster.env,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"the port taker on {node} did not start: {line!r}"
    return proc, int(line)


def test_doctor_port_taken_on_node1(slurm_cluster, tmp_path):
    taker, port = _take_port(slurm_cluster, "node1")
    try:
        cp = srun(slurm_cluster, tmp_path, "node1,node2,node3,node4", *DOCTOR, env=(f"MASTER_PORT={port}",))
    finally:
        taker.kill()
        taker.wait()
    assert cp.returncode != 0
    lines = verdicts(cp.stdout)
    assert set(lines) == {0, 1, 2, 3}, cp.stdout + cp.stderr
    assert f"port {port} on node1 is taken" in lines[0], lines
    for task in (1, 2, 3):  # they reach the foreign program, which never answers as a rendezvous
        assert "port in use" in lines[task] and f"node1:{port}" in lines[task], lines


def test_doctor_missing_rank(slurm_cluster, tmp_path):
    # task 2 never starts the doctor: the other ranks wait for it, bounded by --timeout
    script = f'[ "$SLURM_PROCID" = 2 ] && exit 0; exec {" ".join(DOCTOR)}'
    cp = srun(slurm_cluster, tmp_path, "node1,node2,node3", "bash", "-c", script)
    assert cp.returncode != 0
    lines = verdicts(cp.stdout)
    assert set(lines) == {0, 1}, cp.stdout + cp.stderr
    assert "rank missing" in lines[0] and "expected 3 ranks, 2 arrived" in lines[0], lines
    assert "rank missing" in lines[1], lines


def test_doctor_wrong_world_size(slurm_cluster, tmp_path):
    # a hand-written launch line that sets torchrun-style variables with the wrong WORLD_SIZE
    script = (
        f"RANK=$SLURM_PROCID LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 WORLD_SIZE=3 MASTER_PORT=29533 exec {' '.join(DOCTOR)}"
    )
    cp = srun(slurm_cluster, tmp_path, "node1,node2", "bash", "-c", script)
    assert cp.returncode != 0
    lines = verdicts(cp.stdout)
    assert set(lines) == {0, 1}, cp.stdout + cp.stderr
    assert all("mismatched world size" in line and "WORLD_SIZE=3" in line for line in lines.values()), lines
