"""pytest fixture `slurm_cluster`: a real multi-node Slurm cluster on this machine.

The cluster is managed by the `cluster` script next to this file (see README.md). If one is already
up and healthy with the expected node count, it is reused and left running; otherwise the fixture
starts one and tears it down at the end of the session.

Prerequisites: root, slurm-wlm, munge, iproute2. Without them the tests are skipped, except when
CI=true: then they fail, because in CI no test may be skipped for a missing prerequisite.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ddp_slurm.distributed.groups import NCCL_SHAPED
from ddp_slurm.slurmjob.slurm import ENDED_STATES

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "cluster"
NODES = 4

TERMINAL_STATES = ENDED_STATES  # Slurm will not run the job again


class SlurmError(RuntimeError):
    pass


def parse_scontrol_record(text: str) -> dict[str, str]:
    """Parse one `scontrol show ... -o` line (Key=Value pairs; values may contain spaces or '=')."""
    info: dict[str, str] = {}
    key = None
    for token in text.strip().split(" "):
        m = re.match(r"^([A-Za-z][A-Za-z0-9_:/.]*)=(.*)$", token)
        if m:
            key = m.group(1)
            info[key] = m.group(2)
        elif key is not None:
            info[key] += " " + token
    return info


@dataclass
class SlurmCluster:
    """Handle on the running test cluster. All commands run with `env` (SLURM_CONF set)."""

    env: dict[str, str]
    nodes: list[str]
    state_dir: Path
    addresses: dict[str, str] = field(default_factory=dict)  # node name -> its address
    controller: str = ""
    partition: str = "debug"
    gpus_per_node: int = 2
    started_here: bool = False

    # ------------------------------------------------------------------ commands
    def run(
        self,
        cmd: list[str],
        *,
        cwd: str | os.PathLike | None = None,
        timeout: float = 120,
        check: bool = False,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a command (sbatch, srun, squeue, scontrol, ...) against the cluster; text output captured."""
        cp = subprocess.run(
            [str(c) for c in cmd],
            cwd=cwd,
            env=self.env,
            text=True,
            input=input,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=timeout,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and cp.returncode != 0:
            raise SlurmError(f"{' '.join(map(str, cmd))} failed ({cp.returncode}):\n{cp.stdout}\n{cp.stderr}")
        return cp

    def sbatch(self, args: list[str], cwd: str | os.PathLike | None = None) -> str:
        """Submit with `sbatch --parsable ARGS`; returns the job id."""
        cp = self.run(["sbatch", "--parsable", *args], cwd=cwd, timeout=60)
        if cp.returncode != 0:
            raise SlurmError(f"sbatch {' '.join(map(str, args))} failed ({cp.returncode}): {cp.stderr.strip()}")
        job_id = cp.stdout.strip().splitlines()[-1].split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"unexpected sbatch output: {cp.stdout!r}")
        return job_id

    def job_info(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o JOBID` as a dict (JobState, ExitCode, Restarts, NodeList, Reason, ...).
        Raises SlurmError if Slurm no longer knows the job (MinJobAge is 300 s)."""
        cp = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
        if cp.returncode != 0 or not cp.stdout.strip():
            raise SlurmError(f"scontrol show job {job_id}: {cp.stderr.strip() or 'no output'}")
        # a heterogeneous/array job prints several lines; the first is the job itself
        return parse_scontrol_record(cp.stdout.strip().splitlines()[0])

    def state(self, job_id: str) -> str:
        """Current JobState (e.g. PENDING, RUNNING, COMPLETED)."""
        return self.job_info(job_id)["JobState"]

    def wait_state(
        self, job_id: str, states: set[str] | frozenset[str] | str, timeout: float = 120, poll: float = 0.3
    ) -> dict[str, str]:
        """Wait until the job is in one of `states`; returns its job_info. Raises TimeoutError."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") in wanted:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} not in {sorted(wanted)} after {timeout}s: JobState={info.get('JobState')} "
                    f"Reason={info.get('Reason')}\n{self.log_tail()}"
                )
            time.sleep(poll)

    def wait(self, job_id: str, timeout: float = 120, poll: float = 0.3) -> str:
        """Wait until the job ends (COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, ...)
        and return that final state. A requeued job is not ended: it goes back to PENDING."""
        return self.wait_state(job_id, TERMINAL_STATES, timeout=timeout, poll=poll)["JobState"]

    def exit_code(self, job_id: str) -> tuple[int, int]:
        """(exit status, signal) from scontrol's ExitCode=STATUS:SIGNAL of the batch script."""
        code, _, sig = self.job_info(job_id).get("ExitCode", "0:0").partition(":")
        return int(code), int(sig or 0)

    def release(self, job_id: str, timeout: float = 60) -> None:
        """Start a PENDING job now: `scontrol update JobId=.. StartTime=now`. A requeued job otherwise waits
        its BeginTime (~30-40 s on this cluster, ~2 min on a default Slurm). Waits for it to be PENDING.

        Pitfall: a requeue revokes the job's credential on its node with 1 s resolution; if the job
        restarts there within the same second, slurmd refuses it ("Job credential revoked") and the
        job ends FAILED. So this waits 2 s after seeing the job PENDING before releasing it."""
        self.wait_state(job_id, {"PENDING"}, timeout=timeout)
        time.sleep(2.0)
        deadline = time.monotonic() + timeout
        while True:
            cp = self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], timeout=30)
            if cp.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"could not release job {job_id}: {cp.stderr.strip()}")
            time.sleep(0.5)

    def cancel(self, job_id: str, *args: str) -> None:
        """`scancel ARGS JOBID`, e.g. cancel(j, "--signal=USR2") or cancel(j, "--signal=TERM", "--full")."""
        self.run(["scancel", *args, str(job_id)], check=True, timeout=30)

    def node_exec(self, node: str, cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a command directly inside a node (its network, UTS and mount namespaces), outside of Slurm."""
        pid = (self.state_dir / "run" / f"slurmd-{node}.pid").read_text().split()[0]
        return self.run(["nsenter", "-t", pid, "--net", "--uts", "--mount", "--", *cmd], timeout=timeout)

    def power_off(self, node: str) -> None:
        """``node`` vanishes as a power loss makes it: its link cut, then everything in it killed (slurmd too), so
        no FIN or RST reaches its peers, and Slurm notices only after ``SlurmdTimeout``."""
        res = _cluster_cmd("power-off", node, timeout=60)
        assert res.returncode == 0, res.stderr

    def power_on(self, node: str) -> None:
        """``node`` back after ``power_off``: link up, slurmd started, usable again."""
        res = _cluster_cmd("power-on", node, timeout=120)
        assert res.returncode == 0, res.stderr

    def cancel_all(self) -> None:
        """Cancel every job on the cluster (clean-up after a failed test, so later tests find free nodes)."""
        ids = self.run(["squeue", "-h", "-o", "%i"], timeout=30).stdout.split()
        if ids:
            self.run(["scancel", *ids], timeout=30)

    def log_tail(self, lines: int = 30) -> str:
        """Last lines of the daemon logs (for assertion messages)."""
        out = []
        logdir = self.state_dir / "log"
        for f in sorted(logdir.glob("*.log")) if logdir.is_dir() else []:
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    def wait_idle(self, timeout: float = 90) -> None:
        """Wait until no job is queued or running and every node is idle."""
        deadline = time.monotonic() + timeout
        while True:
            sq = self.run(["squeue", "-h", "-o", "%i"], timeout=30).stdout.split()
            si = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=30).stdout.splitlines()
            states = dict(line.split() for line in si if len(line.split()) == 2)
            if not sq and all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not idle after {timeout}s: jobs {sq}, nodes {states}")
            time.sleep(0.5)


def _cluster_cmd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CLUSTER), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
    )


def _client_env(slurm_conf: str) -> dict[str, str]:
    # Drop Slurm variables inherited from an enclosing job (e.g. tests run inside an allocation):
    # they would leak into sbatch/srun and target the wrong cluster or job.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["SLURM_CONF"] = slurm_conf
    env[NCCL_SHAPED] = "1"  # the jobs' default groups shaped like NCCL's, as every child of the suite (conftest)
    path = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(path + [p for p in ("/usr/sbin", "/sbin") if p not in path])
    return env


def _missing_prerequisite(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(
            f"Slurm test cluster cannot run (CI=true, so this fails instead of skipping): {reason}", pytrace=False
        )
    print(f"\nSKIP slurm cluster tests: {reason}", file=sys.stderr)
    pytest.skip(f"Slurm test cluster unavailable: {reason}")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    check = _cluster_cmd("check", timeout=60)
    if check.returncode != 0:
        _missing_prerequisite((check.stderr or check.stdout).strip().removeprefix("cluster: "))

    started_here = _cluster_cmd("status", timeout=120).returncode != 0
    up = None
    if not started_here:
        info = _read_info()
        if info is None or len(info.get("nodes", [])) != NODES:
            started_here = True  # up --nodes 4 below rebuilds it with the node count the tests need
    up = _cluster_cmd("up", "--nodes", str(NODES), timeout=600)
    if up.returncode != 0:
        pytest.fail(f"`cluster up` failed ({up.returncode}):\n{up.stderr}\n{up.stdout}", pytrace=False)
    m = re.search(r"^export SLURM_CONF=(\S+)$", up.stdout, re.M)
    if not m:
        pytest.fail(f"`cluster up` printed no export line:\n{up.stdout}\n{up.stderr}", pytrace=False)
    info = _read_info() or {}
    cluster = SlurmCluster(
        env=_client_env(m.group(1)),
        nodes=list(info.get("nodes", [])),
        state_dir=Path(m.group(1)).parent,
        addresses=dict(info.get("addresses", {})),
        controller=info.get("controller", ""),
        partition=info.get("partition", "debug"),
        gpus_per_node=int(info.get("gpus_per_node", 2)),
        started_here=started_here,
    )
    try:
        yield cluster
    finally:
        if started_here:
            down = _cluster_cmd("down", timeout=300)
            if down.returncode != 0:
                print(f"\n`cluster down` failed ({down.returncode}):\n{down.stderr}", file=sys.stderr)


def _read_info() -> dict | None:
    state_dir = Path(os.environ.get("DDP_SLURM_CLUSTER_DIR", "/var/lib/ddp-slurm-testcluster"))
    try:
        return json.loads((state_dir / "cluster.json").read_text())
    except (OSError, ValueError):
        return None


def pytest_configure(config: pytest.Config) -> None:
    if not any(str(m).startswith("cluster:") for m in config.getini("markers")):
        config.addinivalue_line(
            "markers", "cluster: needs the real multi-node Slurm test cluster (root, slurm-wlm, munge, iproute2)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents or "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
