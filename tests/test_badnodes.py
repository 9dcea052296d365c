"""Lost nodes: read from the watchdog's own verdict, recorded in the run directory, excluded by submit; a
planted or damaged record is never written through, never blocks, never reaches scontrol or sbatch.
(The requeue without the node runs on the real cluster: tests/cluster/test_faults_cluster.py.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import helpers
import pytest
from conftest import Launcher, base_env, run_bounded

from ddp_slurm import safefs
from ddp_slurm.distributed.watchdog import PeerLost, Watchdog
from ddp_slurm.slurmjob import badnodes


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


# --------------------------------------------------------------------------- a planted or damaged lost_nodes
VICTIM = "victim-host\tnot yours\n"
SURVIVOR = """
import logging, resource, sys
from types import SimpleNamespace
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a /dev/zero read must fail, not take the machine
from ddp_slurm import config
from ddp_slurm.slurmjob import chain
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
cfg = config.load(None, [f"run.output_root={sys.argv[1]}", "run.name=r"], resolve=False)
env = SimpleNamespace(job_id="41", restart_count=0, rank=1, in_slurm_job=True, slurm_job_ref="41")
chain.after_peer_lost(cfg, env, RuntimeError("lost rank 0 (host node3, pid 9): no heartbeat for 7 s"))
print("went on")
"""


def plant(lost_nodes: Path, what: str, victim: Path) -> None:
    if what == "symlink":
        lost_nodes.symlink_to(victim)
    elif what == "dev-zero":
        lost_nodes.symlink_to("/dev/zero")
    elif what == "fifo":
        os.mkfifo(lost_nodes)
    elif what == "directory":
        lost_nodes.mkdir()
    else:  # a host that is not a Slurm host name: it would reach scontrol and sbatch
        lost_nodes.write_text("node1;touch pwned\t41\t0\t2024-01-01T00:00:00\t0\tlost\n")


@pytest.mark.parametrize("what", ["symlink", "dev-zero", "fifo", "directory"])
def test_a_surviving_rank_warns_once_and_goes_on_when_lost_nodes_is_planted(
    tmp_path: Path, launcher: Launcher, what: str
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    (tmp_path / "r").mkdir()
    plant(tmp_path / "r" / "lost_nodes", what, victim)
    res = launcher.run([sys.executable, "-c", SURVIVOR, str(tmp_path)], timeout=60)
    assert res.returncode == 0 and res.stdout == "went on\n", (res.returncode, res.stdout, res.stderr)
    warnings = res.stderr.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("WARNING could not record the lost node(s) node3"), warnings
    assert "lost_nodes" in warnings[0]
    assert victim.read_text() == VICTIM  # never written through


@pytest.mark.parametrize("what", ["symlink", "dev-zero", "fifo", "directory", "bad-host"])
def test_submit_refuses_a_planted_lost_nodes_in_one_line(launcher: Launcher, what: str) -> None:
    victim = launcher.cwd / "victim.txt"
    victim.write_text(VICTIM)
    run_dir = launcher.cwd / "runs" / "r"
    run_dir.mkdir(parents=True)
    plant(run_dir / "lost_nodes", what, victim)
    before = sorted(p.name for p in run_dir.iterdir())
    res = run_bounded(launcher.cwd, "ddp_slurm.submit", "--dry-run", "--name", "r")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stdout, res.stderr)
    assert f"{run_dir / 'lost_nodes'}" in lines[0] and "remove it" in lines[0], lines[0]
    assert res.stdout == "" and sorted(p.name for p in run_dir.iterdir()) == before
    assert victim.read_text() == VICTIM


def test_a_host_that_is_not_a_slurm_name_is_neither_recorded_nor_read_back(tmp_path: Path) -> None:
    assert badnodes.record(tmp_path, ["node2", "$(reboot)"], "41", 0, "lost ranks 1, 2\nsecond line")
    assert badnodes.excluded(tmp_path) == ["node2"]
    assert len((tmp_path / "lost_nodes").read_text().splitlines()) == 1  # the verdict's newline stays in its line
    with open(tmp_path / "lost_nodes", "a") as f:
        f.write("node 4\t41\t1\t-\t0\tplanted\n")
    with pytest.raises(safefs.UnsafePath, match=r"lost_nodes line 2: 'node 4' is not a Slurm host name"):
        badnodes.excluded(tmp_path)


# --------------------------------------------------------------------------- a step of the batch script's supervisor
@pytest.mark.parametrize(("supervisor", "requeued"), [(None, True), ("node1", False), ("node3", True)])
def test_in_a_supervised_step_the_survivor_leaves_the_lost_node_to_the_supervisor(
    tmp_path: Path, launcher: Launcher, supervisor: str | None, requeued: bool
) -> None:
    """The batch script relaunches inside the allocation (launch/supervise.py): the survivor records the lost
    node and requeues nothing, unless the node lost is the supervisor's own (it died with it)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = base_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    if supervisor:
        env["DDP_SLURM_SUPERVISED"] = supervisor
    (tmp_path / "r").mkdir()
    res = launcher.run([sys.executable, "-c", SURVIVOR, str(tmp_path)], timeout=60, env=env)
    assert res.returncode == 0 and res.stdout == "went on\n", res.stderr
    assert badnodes.excluded(tmp_path / "r") == ["node3"]
    assert helpers.requeue_calls(calls) == (["requeue 41"] if requeued else []), res.stderr


@pytest.mark.parametrize("what", ["symlink", "fifo", "range"])
def test_a_damaged_slow_nodes_costs_one_warning_not_the_job(launcher: Launcher, what: str, caplog) -> None:
    """``slow_nodes`` is a hint (the doctor's, the slow-rank check's): damaged (a link, a FIFO, a host range)
    with ``slurm.exclude_slow`` it once ended the job with a traceback before any launch."""
    victim = launcher.cwd / "victim.txt"
    victim.write_text(VICTIM)
    run_dir = launcher.cwd / "runs" / "r"
    run_dir.mkdir(parents=True)
    badnodes.record(run_dir, ["node2"], "41", 0, "lost rank 1")
    if what == "range":
        (run_dir / "slow_nodes").write_text("node[3-4]\t41\t0\t-\t0\tslow\n")
    else:
        plant(run_dir / "slow_nodes", what, victim)
    assert badnodes.excluded(run_dir, slow=True) == ["node2"]
    assert "ignoring" in caplog.text and "slow_nodes" in caplog.text
    res = run_bounded(launcher.cwd, "ddp_slurm.submit", "--dry-run", "--name", "r", "slurm.exclude_slow=true")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "#SBATCH --exclude=node2" in res.stdout, res.stdout[-2000:]
    assert victim.read_text() == VICTIM
