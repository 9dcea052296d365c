"""Nodes a run lost a rank on: named by the watchdog, recorded in the run directory, kept out of the
job's next start.

Why: when a node fails (its daemon dies, its GPU hangs, the kernel kills a rank), requeueing the job
as it is lets Slurm hand it the same node again, and the job fails the same way until the requeue
cap. The watchdog already names the lost rank and its host (``watchdog.PeerLost``); this module makes
that name count:

* every survivor appends each lost host to ``<run_dir>/lost_nodes`` (one line per host and survivor:
  host, job, restart, time, rank, the watchdog's verdict; read back once per host), so the run keeps
  the record across requeues and resubmissions; the survivor whose lines came first speaks for the job;
* inside a Slurm job with ``slurm.requeue`` on and requeues left, it requeues the job (``scontrol
  requeue``) and then excludes the recorded hosts from it (``scontrol update JobId=.. ExcNodeList=..``:
  Slurm accepts a node list change only while the job is pending, so after the requeue, not before);
  the job restarts on other nodes and resumes from the newest checkpoint. Where the requeue is
  refused, ``slurm.requeue_mode`` may chain a successor job instead, with ``--exclude`` (``chain.py``);
* ``submit`` reads the record and asks sbatch for ``--exclude`` on a resubmission (``excluded``).

A rank lost to a bug of its own (an exception on one rank) is not a lost rank: the watchdog sees its
heartbeat end cleanly and says nothing, so no node is blamed for it.

The file lies in a run directory others may reach, and what is read from it goes to ``scontrol`` and
``sbatch``: it is appended to and read only through ``safefs`` (never through a symlink, never into a
FIFO, device or another user's file; read back with a bound), and every host name read back must be a
plain Slurm host name. Anything else is ``safefs.UnsafePath`` naming the file: a surviving rank warns
and goes on failing, ``submit`` refuses in one line.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.slurmjob import slurm

log = logging.getLogger(__name__)

# The watchdog's verdict names each lost rank as "<rank> (host <name>, pid <pid>...": see watchdog._describe.
_LOST = re.compile(r"(\d+) \(host ([^,;)\s]+)")
# The start of the watchdog's and the stall check's verdict (PeerLost): the survivors that record it are leaving the
# step (a guard's record is not such a line: its ranks train on).
LEAVING = re.compile(r"(?:lost|stuck) ranks? \d+ \(host ")
# A Slurm node name as it may go on scontrol's and sbatch's command lines: no whitespace, no shell syntax.
HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def lost(error: BaseException) -> dict[int, str]:
    """``{rank: host}`` of the ranks a ``PeerLost`` names (empty when it names no host)."""
    return {int(rank): host for rank, host in _LOST.findall(str(error)) if host != "unknown"}


def host_name() -> str:
    """This process's node as Slurm names it (what ``--exclude`` takes), or the machine's host name."""
    import os
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def record(
    run_dir: Path,
    hosts: list[str],
    job: str | None,
    restart: int | str,
    why: str,
    rank: int = 0,
    shared: bool = False,
    slow: bool = False,
) -> bool:
    """Append one line per host to ``<run_dir>/lost_nodes`` (tab-separated: host, job, restart, time, the
    recording rank, why; ``restart`` names the launch: the requeue count, ``.N`` for the batch script's Nth
    relaunch inside the allocation). True when this rank's lines are the first for this job and restart: that rank
    speaks for the job (several survivors record; one requeues). ``shared``: ``run.shared`` (a teammate's
    file is fine); ``slow``: to ``slow_nodes`` instead (a slow node, not a lost one). Raises ``safefs.UnsafePath``
    (a symlink, FIFO, foreign or damaged file) or OSError."""
    path = RunPaths(run_dir).slow_nodes if slow else RunPaths(run_dir).lost_nodes
    named = [h for h in hosts if HOST.fullmatch(h)]
    if len(named) < len(hosts):
        log.warning("not recording %s in %s: not Slurm host names", [h for h in hosts if h not in named], path)
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    why = _CONTROL.sub(" ", why)  # one line per host, whatever the verdict holds
    safefs.append_owned(path, "".join(f"{h}\t{job or '-'}\t{restart}\t{when}\t{rank}\t{why}\n" for h in named), shared)
    ours = [line.split("\t") for line in _lines(path)]
    first = next((f for f in ours if len(f) > 4 and f[1] == (job or "-") and f[2] == str(restart)), None)
    return first is not None and first[4] == str(rank)


def excluded(run_dir: Path, slow: bool = False) -> list[str]:
    """The hosts ``<run_dir>/lost_nodes`` names (and ``slow_nodes``, with ``slow``: ``slurm.exclude_slow``),
    first loss first, each once ([] without the file). Raises ``safefs.UnsafePath`` when ``lost_nodes`` is not
    a file this program wrote (a symlink, FIFO, device, too large, a line whose host is not a Slurm host
    name): nothing from it may reach scontrol or sbatch then. A damaged ``slow_nodes`` (a hint the doctor or
    the slow-rank check wrote) is one warning and left out."""
    paths = RunPaths(run_dir)
    hosts = _hosts(paths.lost_nodes)
    if slow:
        try:
            hosts += _hosts(paths.slow_nodes)
        except (safefs.UnsafePath, OSError) as exc:  # a hint, not a record: a damaged one costs a warning
            log.warning("ignoring %s (slurm.exclude_slow): %s", paths.slow_nodes, exc)
    return list(dict.fromkeys(hosts))


def _hosts(path: Path) -> list[str]:
    hosts = []
    for number, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        host = line.split("\t", 1)[0]
        if not HOST.fullmatch(host):
            raise safefs.UnsafePath(
                f"{path} line {number}: {host[:60]!r} is not a Slurm host name; not a file this program wrote: "
                "remove it (or that line)"
            )
        hosts.append(host)
    return hosts


def _lines(path: Path) -> list[str]:
    """The file's lines: never through a symlink, never blocked by a FIFO, at most 1 MiB."""
    return (safefs.read_small(path) or "").splitlines()


def exclude_from(job_ref: str, hosts: list[str]) -> bool:
    """Keep ``hosts`` out of a requeued (pending) job's next start. True when Slurm took it."""
    ok, said = slurm.scontrol("update", f"JobId={job_ref}", f"ExcNodeList={','.join(hosts)}", ignore_term=True)
    if not ok:
        log.warning("requeued, but could not exclude %s from job %s: %s", ",".join(hosts), job_ref, said)
        return False
    log.info("job %s requeued without node(s) %s", job_ref, ",".join(hosts))
    return True
