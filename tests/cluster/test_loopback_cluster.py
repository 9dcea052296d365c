"""The rendezvous node's own host name resolves to a loopback address (127.0.1.1 in its /etc/hosts, as
Debian and many container images write it): every rank, the rendezvous node's included, must
advertise the cluster interface, or gloo's peers dial 127.0.1.1 and the job fails to connect.

node1 gets its own /etc/hosts (bind-mounted inside its mount namespace for this test only, removed
afterwards) mapping ``node1`` to 127.0.1.1; node2 keeps the cluster's, where node1 is 10.77.0.11.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

PY = str(Path(sys.executable).absolute())
WORKER = """
import os, socket, torch, torch.distributed as dist
from ddp_slurm.bootstrap import DistEnv, distributed
from ddp_slurm.distributed.groups import Groups
env = DistEnv.from_environ(os.environ)
with distributed(env, "gloo", timeout_s=60) as (device, backend):
    value = torch.tensor([env.rank + 1.0])
    dist.all_reduce(value, group=Groups.make(device).train)
    # the local addresses of this rank's connections: what gloo really uses (the store's included)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the fd of the listing itself, closed meanwhile
            pass
    listening = set()
    for line in open("/proc/self/net/tcp").read().splitlines()[1:]:
        f = line.split()
        addr, port = f[1].split(":")
        # 0A: LISTEN; the rendezvous store's own port aside, that is gloo's listener, what peers dial
        if f[3] == "0A" and f"socket:[{f[9]}]" in mine and int(port, 16) != env.master_port:
            listening.add(".".join(map(str, bytes.fromhex(addr)[::-1])))
    print(f"GLOO rank={env.rank} listens on {sorted(listening)}", flush=True)
    print(f"OK rank={env.rank} host={socket.gethostname()} resolves={socket.gethostbyname(socket.gethostname())} "
          f"ifname={os.environ.get('GLOO_SOCKET_IFNAME')} sum={value.item():g}", flush=True)
"""


@pytest.fixture
def loopback_node1(slurm_cluster, tmp_path: Path):
    hosts = tmp_path / "hosts-node1"
    lines = [line for line in Path("/etc/hosts").read_text().splitlines() if not re.search(r"\snode1(\s|$)", line)]
    hosts.write_text("\n".join(["127.0.1.1 node1", *lines]) + "\n")
    hosts.chmod(0o644)
    tmp_path.chmod(0o755)
    cp = slurm_cluster.node_exec("node1", ["mount", "--bind", str(hosts), "/etc/hosts"])
    assert cp.returncode == 0, cp.stderr
    try:
        check = slurm_cluster.node_exec("node1", [PY, "-c", "import socket; print(socket.gethostbyname('node1'))"])
        assert check.stdout.strip() == "127.0.1.1", check.stdout + check.stderr
        yield
    finally:
        slurm_cluster.node_exec("node1", ["umount", "/etc/hosts"])


def test_rendezvous_node_with_loopback_hostname_uses_the_cluster_interface(
    slurm_cluster, loopback_node1, tmp_path: Path
) -> None:
    cp = slurm_cluster.run(
        [
            "srun",
            "-N2",
            "-n2",
            "--nodelist=node1,node2",
            "--label",
            "--kill-on-bad-exit=1",
            "env",
            "OMP_NUM_THREADS=1",
            PY,
            "-c",
            WORKER,
        ],
        cwd=tmp_path,
        timeout=600,
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    rows = dict(re.findall(r"OK rank=(\d) (host=.*)", cp.stdout))
    assert set(rows) == {"0", "1"}, cp.stdout + cp.stderr
    gloo = dict(re.findall(r"GLOO rank=(\d) listens on (.*)", cp.stdout))
    assert gloo == {"0": "['10.77.0.11']", "1": "['10.77.0.12']"}, cp.stdout  # no rank offers loopback to peers
    assert "host=node1 resolves=127.0.1.1 ifname=eth0 sum=3" in rows["0"], rows  # the rendezvous node itself
    assert "host=node2" in rows["1"] and "sum=3" in rows["1"], rows
