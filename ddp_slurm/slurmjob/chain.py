"""How a stopped job continues: ``scontrol requeue``, or, where the site forbids it, a chained successor.

Why: some sites submit jobs with ``--no-requeue`` or disable requeueing (``JobRequeue=0``), and then
``scontrol requeue`` fails and a job stopped before its time limit simply ends. ``slurm.requeue_mode``:

* ``requeue``: ``scontrol requeue`` only (the job keeps its id; ``SLURM_RESTART_COUNT`` counts);
* ``chain``: never requeue; submit a successor job instead;
* ``auto`` (default): requeue, and chain when Slurm refuses the requeue.

The successor is ``sbatch --dependency=afterany:<this job>`` of this job's own batch script (``scontrol
write batch_script``), with this job's resources (nodes, tasks, CPUs, GRES, partition, time limit)
and log file (appended), and the training arguments of this rank plus ``run.output_root``/``run.name``,
so that it resumes this run directory even when the run was unnamed (``<task>-<job id>`` would be a
new one). It starts once this job has ended, whatever its state. ``DDP_SLURM_CHAIN`` counts the
links, capped by ``slurm.max_requeues`` like requeues. Nodes to avoid (``slurmjob/badnodes.py``) become
``--exclude``. The script is written into ``<run_dir>/chain/`` (``RunPaths.chain_script``), a real
folder, after whatever a co-tenant planted at its name is removed. The project's sbatch scripts pass their arguments on to training, so the successor
trains the same run; a job started by ``submit`` (submitit) runs a pickle tied to its job id and is
not chained (resubmit it with ``submit``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.slurmjob import badnodes, jobinfo, restarts, slurm

log = logging.getLogger(__name__)

ENV = "DDP_SLURM_CHAIN"
# Variables of this job's processes that would mislead the successor's own launch (sbatch copies the
# environment it is called from): the successor's Slurm sets its own, and a stale rank or address wins.
_STALE = ("SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "TORCHELASTIC_", "PMI_", "PMIX_", "SUBMITIT_")
_STALE_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
_STALE_NAMES |= {"CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES"}


def links() -> int:
    """How many successors led to this job (0: the first job of the chain)."""
    try:
        return int(os.environ.get(ENV, "0"))
    except ValueError:
        return 0


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (``jobinfo.parse_job``: ``(null)`` is '')."""
    ok, out = slurm.scontrol("show", "job", "-o", job_id)
    if not ok or not out.strip():
        raise RuntimeError(f"scontrol show job {job_id}: {out.strip() or 'no output'}")
    return jobinfo.parse_job(out.strip().splitlines()[0])


def resources(info: dict[str, str]) -> list[str]:
    """sbatch options that ask for what this job has (options on the command line beat the script's)."""
    opts = [f"--nodes={info['NumNodes'].split('-')[0]}", f"--ntasks={info['NumTasks']}"]
    per_node = info.get("NtasksPerN:B:S:C", "0").split(":")[0]
    if per_node.isdigit() and int(per_node) > 0:
        opts.append(f"--ntasks-per-node={per_node}")
    for key, opt in (("CPUs/Task", "cpus-per-task"), ("TimeLimit", "time"), ("Partition", "partition")):
        if info.get(key) not in (None, "", "N/A", "UNLIMITED"):
            opts.append(f"--{opt}={info[key]}")
    # --gpus-per-node shows as gres:gpu:N: asked for the same way, it replaces the script's own line
    for item in filter(None, info.get("TresPerNode", "").split(",")):
        name = item.removeprefix("gres:")
        gpus = re.fullmatch(r"gpu:(\d+)", name)
        opts.append(f"--gpus-per-node={gpus[1]}" if gpus else f"--gres={name}")
    if info.get("JobName"):
        opts.append(f"--job-name={info['JobName']}")
    if info.get("StdOut"):  # the same log, appended to: one file tells the whole chain
        opts += [f"--output={info['StdOut']}", "--open-mode=append"]
    if info.get("WorkDir"):
        opts.append(f"--chdir={info['WorkDir']}")
    return opts


def successor(
    job_id: str, run_dir: Path, train_args: list[str], exclude: list[str] = (), shared: bool = False
) -> str | None:
    """Submit the job that continues this one once it ends; its id, or None (with a warning) if not.
    ``shared``: ``run.shared`` (the modes of the ``chain/`` folder)."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        log.warning("cannot chain a successor of job %s: sbatch/scontrol not found; launch again to resume", job_id)
        return None
    try:
        info = job_info(job_id)
        paths = RunPaths(run_dir, shared)
        safefs.make_dir(paths.chain, shared)  # a real folder: a planted symlink there is refused, not followed
        script = paths.chain_script(job_id)
        _clear(script)  # scontrol writes wherever the name leads: nothing planted may be there
        ok, said = slurm.scontrol("write", "batch_script", job_id, str(script))
        if not ok or not _written_by_us(script):
            raise RuntimeError(f"scontrol write batch_script {job_id}: {said.strip() or 'no script written'}")
        opts = [f"--dependency=afterany:{job_id}", "--kill-on-invalid-dep=yes", *resources(info)]
        if exclude:
            opts.append(f"--exclude={','.join(exclude)}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STALE) and k not in _STALE_NAMES}
        if "SLURM_CONF" in os.environ:
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        env[ENV] = str(links() + 1)
        cmd = ["sbatch", "--parsable", *opts, str(script), *train_args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch: {(out.stderr or out.stdout).strip()}")
    except (RuntimeError, OSError, KeyError, subprocess.TimeoutExpired, safefs.UnsafePath) as exc:
        log.warning("could not chain a successor of job %s (%s); launch again to resume", job_id, exc)
        return None
    new = out.stdout.strip().split(";")[0]
    log.info("chained job %s: starts when job %s ends and resumes %s", new, job_id, run_dir)
    return new


def _clear(script: Path) -> None:
    """Remove whatever is at the script's name (a symlink to a victim's file, a FIFO, an empty folder)."""
    try:
        os.unlink(script)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.EISDIR, errno.EPERM):
            raise
        os.rmdir(script)  # a planted folder: removed when empty, else the OSError says why no chain


def _written_by_us(script: Path) -> bool:
    """The script scontrol wrote: a plain file of ours, not something planted between the removal and the write."""
    try:
        st = os.lstat(script)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def continue_job(cfg: Any, env: Any, exclude: list[str] = ()) -> bool:
    """Rank 0 (or the surviving rank that speaks for the job), once the checkpoint is on disk: make the
    job continue as ``slurm.requeue_mode`` says, avoiding ``exclude``. True when something will continue it."""
    from ddp_slurm.slurmjob import slurm

    mode = cfg.slurm.requeue_mode
    if mode != "chain":
        if slurm.requeue(env.slurm_job_ref):
            return not exclude or badnodes.exclude_from(env.slurm_job_ref, list(exclude))
        if mode == "requeue":
            return False
    if os.environ.get("SUBMITIT_EXECUTOR"):
        log.warning("job %s was started by submit: not chained (resubmit it with submit)", env.slurm_job_ref)
        return False
    if env.array_task_id:
        log.warning("job %s is an array task: not chained (resubmit it); launch again to resume", env.slurm_job_ref)
        return False
    if links() >= cfg.slurm.max_requeues:
        log.error("chain cap reached (%d links, slurm.max_requeues=%d): not chaining", links(), cfg.slurm.max_requeues)
        return False
    root = Path(os.path.abspath(cfg.run.output_root))
    args = [*sys.argv[1:], f"run.output_root={root}", f"run.name={cfg.run.name}"]
    return successor(str(env.job_id), cfg.run_dir, args, list(exclude), cfg.run.shared) is not None


def after_peer_lost(cfg: Any, env: Any, error: BaseException) -> None:
    """A survivor, once the watchdog named lost ranks: it records their hosts; the first to record, inside a
    Slurm job with ``slurm.requeue`` on and requeues left, requeues the job without them. Not in a step of the
    batch script's supervisor (``restarts.SUPERVISED``), which relaunches it inside the allocation, unless the
    supervisor's own node is among the lost."""
    gone = badnodes.lost(error)
    if not gone or cfg.run.name is None:
        return
    hosts = sorted(set(gone.values()))
    why = str(error).split(";")[0]
    try:  # every survivor records (the store's host lingers, and the step may end before it gets here)
        # one launch of the job: its requeue count, and which relaunch inside the allocation (supervise.py)
        launch = restarts.launch_label(env.restart_count, restarts.step_restart(os.environ))
        first = badnodes.record(cfg.run_dir, hosts, env.job_id, launch, why, env.rank, cfg.run.shared)
        all_hosts = badnodes.excluded(cfg.run_dir, slow=cfg.slurm.exclude_slow) or hosts
    except (OSError, safefs.UnsafePath) as exc:  # a planted or damaged lost_nodes: this rank fails as it would
        log.warning("could not record the lost node(s) %s in %s: %s", ",".join(hosts), cfg.run_dir, exc)
        return
    supervisor = os.environ.get(restarts.SUPERVISED)
    if supervisor and supervisor not in hosts:  # the batch script relaunches the step on the nodes left
        if first:
            log.info("the job's batch script relaunches training inside the allocation without %s", ",".join(hosts))
        return
    if first and env.in_slurm_job and cfg.slurm.requeue and env.restart_count < cfg.slurm.max_requeues:
        continue_job(cfg, env, exclude=all_hosts)  # requeue (or chain) without them
