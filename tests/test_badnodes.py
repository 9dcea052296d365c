"""Lost nodes: read from the watchdog's own verdict, recorded in the run directory, excluded by submit.
(The requeue without the node runs on the real cluster: tests/cluster/test_faults_cluster.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import Launcher

from ddp_slurm.distributed import badnodes
from ddp_slurm.distributed.watchdog import PeerLost, Watchdog


def test_the_hosts_of_the_watchdogs_verdict() -> None:
    one = Watchdog._describe([(1, "host node2, pid 4711", "no heartbeat for 7 s")])
    two = Watchdog._describe([(1, "host node2, pid 4711", "no heartbeat for 7 s"), (3, "host unknown", "none")])
    assert badnodes.lost(PeerLost(f"{one}; this rank's collective failed with: x")) == {1: "node2"}
    assert badnodes.lost(PeerLost(two)) == {1: "node2"}  # a rank whose host is unknown blames no node
    store = "lost rank 0 (host gpu-a7, pid 12, store at gpu-a7:29500): the rendezvous store it hosted is unreachable"
    assert badnodes.lost(PeerLost(store)) == {0: "gpu-a7"}
    assert badnodes.lost(PeerLost("lost the torchrun agent at n1:29400: ...")) == {}


def test_recorded_hosts_are_read_back_once_each_in_order(tmp_path: Path) -> None:
    assert badnodes.excluded(tmp_path) == []
    assert badnodes.record(tmp_path, ["node3"], "41", 0, "lost rank 1 (host node3, pid 9)", rank=2)
    assert not badnodes.record(tmp_path, ["node3"], "41", 0, "lost rank 1 (host node3, pid 9)", rank=0)  # 2 was first
    assert badnodes.record(tmp_path, ["node1", "node3"], "41", 1, "lost ranks ...", rank=0)  # the next restart
    assert badnodes.excluded(tmp_path) == ["node3", "node1"]
    assert (tmp_path / "lost_nodes").read_text().splitlines()[0].startswith("node3\t41\t0\t")


def test_a_resubmission_excludes_the_nodes_the_run_lost(launcher: Launcher) -> None:
    run_dir = launcher.cwd / "runs" / "r"
    run_dir.mkdir(parents=True)
    badnodes.record(run_dir, ["node3"], "41", 0, "lost rank 1 (host node3, pid 9)")
    submit = [sys.executable, "-m", "ddp_slurm.submit", "--dry-run", "--name", "r"]
    res = launcher.run([*submit, "--sbatch", "exclude=node9"], check=True)
    assert "#SBATCH --exclude=node9,node3\n" in res.stdout, res.stdout
    other = launcher.run([*submit[:-1], "other"], check=True)
    assert "--exclude" not in other.stdout
