"""``python -m ddp_slurm.launch.supervise [--torchrun NPROC] -- PYTHON -m ddp_slurm.train ...``: the batch script's
training step, relaunched inside the allocation when a node is lost (``slurmjob/restarts.py`` decides).

The batch script keeps its allocation when a node fails (``#SBATCH --no-kill``: Slurm then drops the node
from the job and lets it run on). This runs the training step with ``srun`` on the job's nodes and, when the
step ends, asks ``restarts.decide``:

- a lost node (the survivors named it in ``<run dir>/lost_nodes``, or Slurm dropped it from the job): the step
  is launched again on the nodes left, as many as the global batch splits over, and the run resumes from its
  newest checkpoint at that world size. Same job id, no requeue, no queue wait; ``slurm.restarts`` times.
  ``slurm.spare_nodes``: that many of the job's nodes wait outside the first launch, so that a relaunch
  after a loss trains on as many nodes as before;
- a launch that failed before any rank started training: launched again after 2 s (``MAX_LAUNCH_RETRIES``);
- anything else ends the job with the step's exit code, as ``srun`` alone would.

A node that vanishes without a word (power loss, cut link, a hung GPU's rank frozen) keeps ``srun`` waiting
for its tasks until Slurm's node timeout (``SlurmdTimeout``, 300 s by default), even after the survivors have
named it (the stall check) and left. So once they have recorded such a loss in ``lost_nodes``, ``srun`` gets
``STEP_GRACE_S`` to end by itself, and is ended here otherwise. Slurm may keep that step's remains on the
nodes left until it gives the node up, so a relaunch asks for ``--overlap``; each launch gets a fresh
``MASTER_PORT`` (a rank of the last launch that cannot be killed, stuck in the kernel on a hung device, may
still hold the old one) and its own flight-recorder files (``flightrec.launch_prefix``: ``<job>.<restart>.<N>-rank``).

``sbatch/mnist_4node.sh`` runs one srun task per rank; ``sbatch/mnist_torchrun.sh`` (``--torchrun NPROC``) one
per node, a torchrun agent starting NPROC ranks, its rendezvous on the first node of each launch. A ``submit``
job (``--submitit``) runs submitit's own ``srun`` command through it: submit's script defines ``srun`` as a
shell function that calls this (``launch/plan.py``), and each launch runs the pickled job on the nodes given.

Every decision is one log line. The relaunched run's ``start`` line in metrics.jsonl says which relaunch it is
(``restart_in_allocation``), and ``report`` shows it. The steps run with ``DDP_SLURM_SUPERVISED`` naming this
host: survivors of a lost rank then only record it, and requeue the job themselves only when this host is
the one lost (the batch script dies with its node, and Slurm would leave the job a zombie).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ddp_slurm import argtypes, errors, safefs
from ddp_slurm.distributed import flightrec
from ddp_slurm.distributed.env import PORT_BASE, PORT_SPAN, derive_port, expand_hostlist, tasks_per_node
from ddp_slurm.exitcodes import EXIT_FAILURE, EXIT_USAGE
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.slurmjob import badnodes, jobinfo, restarts, slurm

log = logging.getLogger("ddp_slurm")

RETRY_DELAY_S = 2.0  # a requeue revokes the job's credential with 1-second resolution
RELAUNCH_DELAY_S = 1.0
STEP_GRACE_S = 2.0  # survivors recorded a lost rank: what srun gets to end by itself before it is ended
POLL_S = 0.5


def _run_dir(train: list[str]) -> tuple[Path, Any]:
    """The run directory the training step will use: its config read as the step reads it."""
    from ddp_slurm import config
    from ddp_slurm.train import runname

    args = list(train[train.index("ddp_slurm.train") + 1 :]) if "ddp_slurm.train" in train else []
    path = None
    if args[:1] == ["--config"]:
        path, args = args[1], args[2:]
    cfg = config.load(path, args, resolve=False)
    job = os.environ["SLURM_JOB_ID"]
    ref = (
        f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        if os.environ.get("SLURM_ARRAY_TASK_ID")
        else job
    )
    cfg.run.name = cfg.run.name or runname.job_name(cfg, ref)
    return cfg.run_dir, cfg


def _live_nodes(job: str) -> tuple[str, ...]:
    ok, text = slurm.scontrol("show", "job", "-o", job)
    nodes = jobinfo.parse_job(text).get("NodeList", "") if ok else ""
    return tuple(expand_hostlist(nodes)) if nodes and nodes != "(null)" else ()


def _starts(path: Path) -> int:
    """The run's ``start`` lines so far (one more after a step: a rank began training)."""
    try:  # never through a link, never blocked by a FIFO (a co-tenant's plant): a plain file or nothing
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return 0
    with open(fd, errors="replace") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return 0
        return sum(1 for line in f if '"kind": "start"' in line)


def _lost_lines(path: Path) -> list[str]:
    """``lost_nodes``'s lines, read as ``badnodes`` reads them (no link, FIFO or foreign file; bounded)."""
    try:
        return (safefs.read_small(path) or "").splitlines()
    except (OSError, safefs.UnsafePath) as exc:
        log.warning("cannot read %s: %s", path, exc)
        return []


def _lost_since(path: Path, before: int, job: str, launch: str) -> tuple[str, ...]:
    """Hosts recorded lost by this job after the first ``before`` lines, but for a late verdict of an earlier
    launch (``launch``: this one's ``restarts.launch_label``), whose ranks may still record as this one starts."""
    fields = [line.split("\t") for line in _lost_lines(path)[before:]]
    stale = {i for i, f in enumerate(fields) if len(f) > 5 and f[2] != launch and badnodes.LEAVING.match(f[5])}
    named = {f[0] for i, f in enumerate(fields) if len(f) > 1 and f[1] == job and i not in stale}
    return tuple(sorted(h for h in named if badnodes.HOST.fullmatch(h)))


def _leaving_since(path: Path, before: int, job: str, launch: str) -> tuple[str, ...]:
    """Hosts recorded lost after the first ``before`` lines by survivors of this launch of the job (``launch``:
    ``restarts.launch_label``) that are leaving the step (a watchdog or stall verdict; not a guard's record,
    whose ranks train on; not a late line of an earlier launch)."""
    fields = [line.split("\t") for line in _lost_lines(path)[before:]]
    named = {f[0] for f in fields if len(f) > 5 and f[1:3] == [job, launch] and badnodes.LEAVING.match(f[5])}
    return tuple(sorted(named))


def _run_step(cmd: list[str], env: dict[str, str], lost: Path, before: int, job: str, launch: str) -> int:
    """srun's exit status; srun ended here ``STEP_GRACE_S`` after the survivors recorded a lost rank (it
    would wait for a vanished node's tasks until Slurm's node timeout)."""
    proc = subprocess.Popen(cmd, env=env)
    named_at = None
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if named_at is None:
            named_at = time.monotonic() if _leaving_since(lost, before, job, launch) else None
        elif time.monotonic() - named_at >= STEP_GRACE_S:
            log.warning(
                "job %s: the survivors named %s lost and left, but srun still waits for it (Slurm notices a "
                "silent node only after its node timeout): ending the step",
                job,
                ",".join(_leaving_since(lost, before, job, launch)),
            )
            proc.terminate()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return EXIT_FAILURE


def fresh_port(base: int, launch: int) -> int:
    """The rendezvous port of the ``launch``-th srun of the job (0: ``base`` itself): another one each launch, in
    the range ``derive_port`` uses when ``base`` is in it."""
    if PORT_BASE <= base < PORT_BASE + PORT_SPAN:
        return PORT_BASE + (base - PORT_BASE + launch) % PORT_SPAN
    return base + launch if base + launch <= 65535 else base - launch


def _base_port(job: str) -> int:
    """The port the training's bootstrap takes in this job (``MASTER_PORT`` if exported, else derived)."""
    given = os.environ.get("MASTER_PORT", "")
    if given.isdigit() and 0 < int(given) <= 65535:
        return int(given)
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return derive_port(array, task) if array and task else derive_port(job)


def _command(train: list[str], nodes: tuple[str, ...], torchrun: int, port: int, rdzv_id: str) -> list[str]:
    """What each srun task runs: ``train`` itself (one task per rank), or with ``torchrun`` (processes per node)
    ``PYTHON -m ddp_slurm.launch`` starting them, its rendezvous on the first of ``nodes``, which are the nodes
    of this launch (the batch script's own head node may be the one lost)."""
    if not torchrun:
        return train
    return [
        train[0],
        "-m",
        "ddp_slurm.launch",
        f"--nnodes={len(nodes)}",
        f"--nproc-per-node={torchrun}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={nodes[0]}:{port}",
        f"--rdzv-id={rdzv_id}",
        *train[1:],
    ]


def main(argv: list[str] | None = None) -> int:
    p = argtypes.OneLineParser(prog="python -m ddp_slurm.launch.supervise", description=__doc__.splitlines()[0])
    p.add_argument(
        "--torchrun",
        type=argtypes.integer(0, 1024),
        default=0,
        metavar="NPROC",
        help="one task per node, each torchrun (python -m ddp_slurm.launch) starting NPROC ranks",
    )
    p.add_argument(
        "--rdzv-port",
        type=argtypes.integer(1, 65535),
        default=29400,
        help="torchrun's rendezvous port (with --torchrun)",
    )
    p.add_argument(
        "--submitit",
        metavar="TRAIN_ARGS",
        help="a submit job: the training's arguments (one shell-quoted string); after -- srun's own arguments and "
        "command as submitit's script gives them",
    )
    p.add_argument(
        "train", nargs=argparse.REMAINDER, help="-- PYTHON -m ddp_slurm.train [--config FILE] [KEY=VALUE ...]"
    )
    args = p.parse_args(argv)
    try:
        return _supervise(args)
    except errors.UsageError as exc:  # outside a job, forged Slurm variables: one line, never a traceback
        sys.stderr.write(f"{p.prog}: error: {exc}\n")
        return EXIT_USAGE


def _job_environment() -> tuple[str, tuple[str, ...], int]:
    """(job id, its nodes, srun's tasks per node) from Slurm's variables; UsageError naming the one missing or
    not Slurm's (a forged value, a node list past the cap: ``distributed.env``'s own checks)."""
    job = os.environ.get("SLURM_JOB_ID", "")
    listed = os.environ.get("SLURM_JOB_NODELIST", "")
    if not job.isdigit() or not listed:
        raise errors.UsageError(
            "runs inside a Slurm job only (the batch script's training step): SLURM_JOB_ID and SLURM_JOB_NODELIST "
            "are not both set; outside Slurm use python -m ddp_slurm.launch"
        )
    name = "SLURM_NTASKS_PER_NODE" if os.environ.get("SLURM_NTASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    per_node = tasks_per_node(name, os.environ.get(name) or "1")
    return job, tuple(expand_hostlist(listed)), per_node[0]


def _supervise(args: argparse.Namespace) -> int:
    job, listed, per_node = _job_environment()
    train = args.train[1:] if args.train[:1] == ["--"] else args.train
    given = train  # what each launch runs: the training command, or submitit's srun arguments and command
    if args.submitit is not None:
        train = [sys.executable, "-m", "ddp_slurm.train", *shlex.split(args.submitit)]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "1")
    port = args.rdzv_port

    def launch(nodes: tuple[str, ...], made: int) -> list[str]:
        """What srun runs: submitit's command as given, or the training's (a fresh rendezvous each launch)."""
        if args.submitit is not None:
            return given
        return _command(train, nodes, args.torchrun, port + made, f"{job}.{made}")

    try:
        run_dir, cfg = _run_dir(train)
    except Exception as exc:  # a config the step will refuse itself, in its own words: run it once, as srun would
        log.info("job %s: not supervising the training step (%s)", job, str(exc).splitlines()[0])
        step = launch(listed, 0)
        return subprocess.run(["srun", "--kill-on-bad-exit=1", f"--cpus-per-task={cpus}", *step]).returncode
    paths = RunPaths(run_dir)
    tasks = 1 if args.torchrun else max(per_node, 1)  # srun's tasks per node
    ranks = args.torchrun or tasks  # training ranks per node
    nodes = _live_nodes(job) or listed
    spare = cfg.slurm.spare_nodes
    if spare:
        if spare >= len(nodes):
            log.error("slurm.spare_nodes=%d leaves none of the job's %d node(s) to train on", spare, len(nodes))
            return 2
        nodes = nodes[: len(nodes) - spare]  # the last ones wait: a relaunch after a loss takes them
        log.info(
            "job %s: training on %s; spare node(s) %s", job, ",".join(nodes), ",".join(_live_nodes(job)[len(nodes) :])
        )
    me = badnodes.host_name()
    made = tried = 0
    avoid = badnodes.excluded(run_dir, slow=True) if cfg.slurm.exclude_slow else []  # slow nodes named before
    if avoid and [n for n in nodes if n not in avoid]:
        log.info("job %s: leaving out %s (slurm.exclude_slow)", job, ",".join(n for n in nodes if n in avoid))
        nodes = tuple(n for n in nodes if n not in avoid)
    nodes, waiting = restarts.first_nodes(nodes, restarts.splits_over(cfg, ranks))  # the relaunch's rule, at start too
    if not nodes:
        log.error(
            "job %s: the global batch splits over none of 1-%d node(s) x %d rank(s) left to train on; "
            "ask for a node count it splits over",
            job,
            len(waiting),
            ranks,
        )
        return EXIT_USAGE
    if waiting:
        log.warning(
            "job %s: training on %s, the most nodes the global batch splits over; %s wait",
            job,
            ",".join(nodes),
            ",".join(waiting),
        )
    launches = 0
    while True:
        before_lost, before_starts = len(_lost_lines(paths.lost_nodes)), _starts(paths.metrics)
        env = dict(os.environ, **{restarts.STEP_RESTART: str(made)})
        if made < cfg.slurm.restarts:
            env[restarts.SUPERVISED] = me
        if launches and not args.torchrun:  # torchrun's rendezvous takes port + made already
            env["MASTER_PORT"] = str(fresh_port(_base_port(job), launches))
        for name in flightrec.PREFIX_VARS:  # each launch its own traces: a relaunch must not overwrite the first's
            if os.environ.get(name):
                env[name] = flightrec.launch_prefix(os.environ[name], made)
        cmd = [
            "srun",
            "--kill-on-bad-exit=1",
            # a vanished node's step may linger on the nodes left until Slurm gives the node up
            *(["--overlap"] if made else []),
            f"--cpus-per-task={cpus}",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * tasks}",
            f"--ntasks-per-node={tasks}",
            f"--nodelist={','.join(nodes)}",
            # submitit's logs: the batch script's and rank 0's are one file, kept whole across launches
            *(["--open-mode=append"] if args.submitit is not None else []),
            *launch(nodes, made),
        ]
        launches += 1
        label = restarts.launch_label(os.environ.get("SLURM_RESTART_COUNT", "0"), made)
        status = _run_step(cmd, env, paths.lost_nodes, before_lost, job, label)
        step = restarts.Step(
            status,
            _starts(paths.metrics) > before_starts,
            nodes,
            _lost_since(paths.lost_nodes, before_lost, job, label),
            _live_nodes(job),
        )
        avoid = sorted(set(avoid) | set(step.lost))
        plan = restarts.decide(
            step,
            restarts=made,
            retries=tried,
            cap=cfg.slurm.restarts,
            avoid=avoid,
            fits=restarts.splits_over(cfg, ranks),
            global_batch=cfg.train.global_batch_size,
        )
        if plan.action == "exit":
            if plan.why:
                log.info("job %s: training step exited %d: %s; not relaunching", job, status, plan.why)
            return plan.code
        if plan.action == "retry":
            tried += 1
            log.warning(
                "job %s: %s; launching again in %.0f s (try %d of %d)",
                job,
                plan.why,
                RETRY_DELAY_S,
                tried + 1,
                restarts.MAX_LAUNCH_RETRIES + 1,
            )
            time.sleep(RETRY_DELAY_S)
            continue
        made, tried = made + 1, 0
        log.warning(
            "job %s: %s: relaunching training inside the allocation on %d node(s) %s from the newest "
            "checkpoint (restart %d of slurm.restarts=%d; no requeue)",
            job,
            plan.why,
            len(plan.nodes),
            ",".join(plan.nodes),
            made,
            cfg.slurm.restarts,
        )
        nodes = plan.nodes
        time.sleep(RELAUNCH_DELAY_S)  # the failed step's tasks are reaped (its port is not reused: fresh_port)


if __name__ == "__main__":
    sys.exit(main())
