"""Tests of the Slurm test cluster itself: what the project's end-to-end tests rely on."""

from __future__ import annotations

import ipaddress
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def _wait_for_file(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.1)
    return path.read_text()


def _script(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body).lstrip())
    path.chmod(0o755)
    return path


def test_all_nodes_idle(slurm_cluster):
    assert slurm_cluster.nodes == [f"node{i}" for i in range(1, 5)]
    slurm_cluster.wait_idle(timeout=60)
    out = slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %T %P"], check=True).stdout
    rows = sorted(line.split() for line in out.splitlines())
    assert rows == [[n, "idle", "debug*"] for n in slurm_cluster.nodes]


def test_srun_runs_one_task_per_node_with_its_own_hostname(slurm_cluster):
    n = len(slurm_cluster.nodes)
    cp = slurm_cluster.run(["srun", f"-N{n}", f"-n{n}", "hostname"], check=True, timeout=60)
    assert sorted(cp.stdout.split()) == sorted(slurm_cluster.nodes)


def test_nodes_have_distinct_addresses(slurm_cluster):
    cp = slurm_cluster.run(["srun", "-N2", "-n2", "hostname", "-I"], check=True, timeout=60)
    addrs = [line.split()[0] for line in cp.stdout.splitlines() if line.strip()]
    assert len(addrs) == 2 and len(set(addrs)) == 2, cp.stdout
    for a in addrs:
        assert not ipaddress.ip_address(a).is_loopback
        assert a in slurm_cluster.addresses.values()


def test_node_names_resolve_from_every_node(slurm_cluster):
    """Each node's hostname resolves, on every node, to that node's own non-loopback address
    (the first host of SLURM_JOB_NODELIST is the rendezvous address of a multi-node job)."""
    nodes = slurm_cluster.nodes
    script = "echo SELF $(hostname) $(hostname -I); " + "; ".join(
        f"echo RES {n} $(getent ahostsv4 {n} | awk 'NR==1{{print $1}}')" for n in nodes
    )
    cp = slurm_cluster.run(
        ["srun", f"-N{len(nodes)}", f"-n{len(nodes)}", "--label", "bash", "-c", script], check=True, timeout=60
    )
    seen_self = {}
    resolved: dict[str, dict[str, str]] = {}
    for line in cp.stdout.splitlines():
        task, _, rest = line.partition(": ")
        fields = rest.split()
        if fields[0] == "SELF":
            seen_self[task] = (fields[1], fields[2])
        elif fields[0] == "RES":
            resolved.setdefault(task, {})[fields[1]] = fields[2] if len(fields) > 2 else ""
    assert len(seen_self) == len(nodes), cp.stdout
    for task, (host, addr) in seen_self.items():
        assert slurm_cluster.addresses[host] == addr
        assert resolved[task] == slurm_cluster.addresses, f"resolution on {host}: {resolved[task]}"


def test_node_exec_enters_a_node(slurm_cluster):
    cp = slurm_cluster.node_exec("node2", ["sh", "-c", "hostname; hostname -I; getent ahostsv4 node1"])
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.split("\n")
    assert lines[0] == "node2"
    assert lines[1].split() == [slurm_cluster.addresses["node2"]]
    assert lines[2].split()[0] == slurm_cluster.addresses["node1"]


def test_tcp_between_nodes(slurm_cluster, tmp_path):
    """A task on one node can connect to a task on another (what a DDP rendezvous does)."""
    prog = _script(
        tmp_path / "pingpong.py",
        """
        import os, socket, subprocess, sys, time
        rank = int(os.environ["SLURM_PROCID"])
        first = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()[0]
        port = 29000 + int(os.environ["SLURM_JOB_ID"]) % 1000
        if rank == 0:
            srv = socket.create_server((socket.gethostbyname(first), port))
            srv.settimeout(30)
            conn, peer = srv.accept()
            conn.sendall(b"pong from " + socket.gethostname().encode())
            print("served", peer[0])
        else:
            for _ in range(300):
                try:
                    c = socket.create_connection((first, port), timeout=5)
                    break
                except OSError:
                    time.sleep(0.1)
            print("got", c.recv(100).decode(), "on", socket.gethostname())
        """,
    )
    cp = slurm_cluster.run(["srun", "-N2", "-n2", "--label", sys.executable, str(prog)], timeout=90)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "pong from node" in cp.stdout, cp.stdout


def test_batch_job_with_fake_gpus(slurm_cluster, tmp_path):
    out = tmp_path / "gpu.out"
    job = slurm_cluster.sbatch(
        ["-N2", "--gpus-per-node=2", "-o", str(out), "--wrap", "srun hostname; echo gpus=$SLURM_GPUS_ON_NODE"],
        cwd=tmp_path,
    )
    assert slurm_cluster.wait(job, timeout=60) == "COMPLETED", slurm_cluster.job_info(job)
    assert slurm_cluster.exit_code(job) == (0, 0)
    text = out.read_text()
    assert "gpus=2" in text
    assert sorted(l for l in text.split() if l.startswith("node")) == ["node1", "node2"]
    assert slurm_cluster.job_info(job).get("TresPerNode", "").endswith("gpu:2")
    # --gpus-per-task is accepted too
    cp = slurm_cluster.run(["srun", "-N1", "-n2", "--gpus-per-task=1", "true"], timeout=60)
    assert cp.returncode == 0, cp.stderr


def test_failed_job_reports_exit_code(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch(["-o", "/dev/null", "--wrap", "exit 3"], cwd=tmp_path)
    assert slurm_cluster.wait(job, timeout=60) == "FAILED"
    assert slurm_cluster.exit_code(job) == (3, 0)


def test_scontrol_show_hostnames(slurm_cluster):
    def hostnames(expr):
        return slurm_cluster.run(["scontrol", "show", "hostnames", expr], check=True).stdout.split()

    assert hostnames("node[1-4]") == ["node1", "node2", "node3", "node4"]
    assert hostnames("node[1,3-4]") == ["node1", "node3", "node4"]


def test_requeue_and_release(slurm_cluster, tmp_path):
    out = tmp_path / "requeue.out"
    script = _script(
        tmp_path / "requeue.sh",
        """
        #!/bin/bash
        #SBATCH --requeue
        #SBATCH --open-mode=append
        echo "run restart=${SLURM_RESTART_COUNT:-0} on $(hostname)"
        if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
            scontrol requeue "$SLURM_JOB_ID"
            sleep 120      # killed by the requeue
            exit 1
        fi
        echo second-run-ok
        """,
    )
    job = slurm_cluster.sbatch(["-o", str(out), str(script)], cwd=tmp_path)
    t0 = time.monotonic()
    # after the requeue the job is PENDING (Reason=BeginTime) with Restarts=1
    deadline = time.monotonic() + 60
    while True:
        info = slurm_cluster.job_info(job)
        if info["Restarts"] == "1" or info["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    slurm_cluster.release(job)
    assert slurm_cluster.wait(job, timeout=60) == "COMPLETED", slurm_cluster.job_info(job)
    info = slurm_cluster.job_info(job)
    assert info["Restarts"] == "1"
    assert slurm_cluster.exit_code(job) == (0, 0)
    text = out.read_text()
    assert "run restart=0" in text and "run restart=1" in text and "second-run-ok" in text, text
    assert time.monotonic() - t0 < 30, "release should restart the job at once"


def test_scancel_signal_reaches_job_step(slurm_cluster, tmp_path):
    ready, got = tmp_path / "ready", tmp_path / "got"
    step = _script(
        tmp_path / "step.sh",
        f"""
        #!/bin/bash
        trap 'echo usr2 > {got}; exit 0' USR2
        echo $$ > {ready}
        while :; do sleep 0.2; done
        """,
    )
    job = slurm_cluster.sbatch(["-o", str(tmp_path / "sig.out"), "--wrap", f"srun {step}"], cwd=tmp_path)
    _wait_for_file(ready, timeout=60)
    slurm_cluster.cancel(job, "--signal=USR2")
    assert _wait_for_file(got, timeout=30).strip() == "usr2"
    assert slurm_cluster.wait(job, timeout=60) == "COMPLETED", slurm_cluster.job_info(job)
