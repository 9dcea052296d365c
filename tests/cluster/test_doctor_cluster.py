"""`srun python -m ddp_slurm.doctor` on the real multi-node test cluster: OK, and faults that must each
end in a clear per-rank verdict and a non-zero exit instead of a hang."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_slurm.slurmjob import badnodes

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


def _in_node(cluster, node: str, *command: str) -> None:
    """Run ``command`` in ``node``'s network namespace (the one its slurmd runs in)."""
    pid = (cluster.state_dir / "run" / f"slurmd-{node}.pid").read_text().split()[0]
    subprocess.run(["nsenter", "-t", pid, "--net", "--", *command], check=True, timeout=30)


FOUR = "node1,node2,node3,node4"
SLOW = [PY, "-m", "ddp_slurm.doctor", "--size-mb", "1", "--iters", "2", "--link-mb", "1"]


def test_doctor_names_a_node_whose_links_are_limited(slurm_cluster, tmp_path):
    """node2's veth limited to 40 Mbit/s both ways (``tc ... tbf``: the kernel here has no netem): every link to
    and from node2 in the ring probe is far below the others' median, so node2 is named, not its links."""
    shape = ["tc", "qdisc", "add", "dev"], ["root", "tbf", "rate", "40mbit", "burst", "64kb", "latency", "100ms"]
    subprocess.run([*shape[0], "dsveth2", *shape[1]], check=True, timeout=30)  # to node2
    try:
        _in_node(slurm_cluster, "node2", *shape[0], "eth0", *shape[1])  # from node2
        try:
            cp = srun(slurm_cluster, tmp_path, FOUR, *SLOW, "--timeout", "30")
        finally:
            _in_node(slurm_cluster, "node2", "tc", "qdisc", "del", "dev", "eth0", "root")
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "dsveth2", "root"], check=True, timeout=30)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    slow = [line for line in cp.stdout.splitlines() if "doctor: FAIL" in line and ": slow: " in line]
    assert len(slow) == 1 and "FAIL node2: slow: every link to and from it is slow" in slow[0], cp.stdout


def test_doctor_names_a_node_starved_of_cpu_and_records_it(slurm_cluster, tmp_path):
    """node2's doctor runs in a cgroup with a tenth of one CPU (cgroup v1 ``cpu.cfs_quota_us``): its compute
    probe is several times slower than the other nodes' median; ``--exclude-slow`` writes it to the run's
    ``slow_nodes``, the list the launchers read."""
    group = Path("/sys/fs/cgroup/cpu/ddps-starved")
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text("10000")
    run = tmp_path / "runs" / "next"  # a run directory of its own (the doctor never makes one)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    starve = f'[ "$SLURMD_NODENAME" = node2 ] && echo $$ > {group}/cgroup.procs; exec "$@"'
    try:
        cp = srun(
            slurm_cluster,
            tmp_path,
            FOUR,
            "sh",
            "-c",
            starve,
            "sh",
            *SLOW,
            "--timeout",
            "120",
            "--exclude-slow",
            str(run),
        )
    finally:
        deadline = time.monotonic() + 30
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        group.rmdir()
    assert cp.returncode == 1, cp.stdout + cp.stderr
    slow = [line for line in cp.stdout.splitlines() if "doctor: FAIL" in line and ": slow: " in line]
    assert len(slow) == 1 and re.search(r"FAIL node2: slow: computes \d+\.\dx slower", slow[0]), cp.stdout
    assert f"recorded node2 in {run}/slow_nodes" in cp.stdout
    assert badnodes.excluded(run, slow=True) == ["node2"] and badnodes.excluded(run) == []
