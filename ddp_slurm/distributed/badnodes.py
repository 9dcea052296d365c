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
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from ddp_slurm.distributed import slurm

log = logging.getLogger(__name__)

FILE = "lost_nodes"
# The watchdog's verdict names each lost rank as "<rank> (host <name>, pid <pid>...": see watchdog._describe.
_LOST = re.compile(r"(\d+) \(host ([^,;)\s]+)")


def lost(error: BaseException) -> dict[int, str]:
    """``{rank: host}`` of the ranks a ``PeerLost`` names (empty when it names no host)."""
    return {int(rank): host for rank, host in _LOST.findall(str(error)) if host != "unknown"}


def record(run_dir: Path, hosts: list[str], job: str | None, restart: int, why: str, rank: int = 0) -> bool:
    """Append one line per host to ``<run_dir>/lost_nodes`` (tab-separated: host, job, restart, time, the
    recording rank, why). True when this rank's lines are the first for this job and restart: that rank
    speaks for the job (several survivors record; one requeues)."""
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    text = "".join(f"{h}\t{job or '-'}\t{restart}\t{when}\t{rank}\t{why}\n" for h in hosts)
    path = Path(run_dir) / FILE
    with open(path, "a") as f:  # O_APPEND: each survivor's few lines land whole
        f.write(text)
    ours = [line.split("\t") for line in path.read_text().splitlines()]
    first = next((f for f in ours if len(f) > 4 and f[1] == (job or "-") and f[2] == str(restart)), None)
    return first is not None and first[4] == str(rank)


def excluded(run_dir: Path) -> list[str]:
    """The hosts ``<run_dir>/lost_nodes`` names, first loss first, each once."""
    try:
        lines = (Path(run_dir) / FILE).read_text().splitlines()
    except OSError:
        return []
    return list(dict.fromkeys(line.split("\t", 1)[0] for line in lines if line.strip()))


def exclude_from(job_ref: str, hosts: list[str]) -> bool:
    """Keep ``hosts`` out of a requeued (pending) job's next start. True when Slurm took it."""
    ok, said = slurm.scontrol("update", f"JobId={job_ref}", f"ExcNodeList={','.join(hosts)}", ignore_term=True)
    if not ok:
        log.warning("requeued, but could not exclude %s from job %s: %s", ",".join(hosts), job_ref, said)
        return False
    log.info("job %s requeued without node(s) %s", job_ref, ",".join(hosts))
    return True
