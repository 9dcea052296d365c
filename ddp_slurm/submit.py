"""``python -m ddp_slurm.submit [options] [KEY=VALUE ...]``: the training job through submitit.

The same training as ``python -m ddp_slurm.train`` (same config, overrides, run directory, exit
codes), submitted from Python with a submitit ``AutoExecutor``: one ``srun`` task per rank on Slurm,
or ``--cluster local`` (N processes on this machine) / ``--cluster debug`` (in this process).

Options default to the config's ``slurm`` section and, when given, become config overrides
(``--nodes 4`` is ``slurm.nodes=4``), so the run directory's config.yaml records what was asked.
The job asks for ``--signal=<slurm.signal>@<signal_delay_s>`` and ``--requeue``; training's own
signal handling stops every rank at the same step, checkpoints, and rank 0 requeues the job once
(see ``submit_job``). ``--sweep KEY=V1,V2`` submits a job array, one run per value (see ``sweep``).

Exit status: 0 submitted (with ``--wait``: finished); 2 bad options or config, nothing submitted and
no run directory created; with ``--wait``, training's status otherwise (1 failure, 3 requeue cap,
75 stopped with a checkpoint and not requeued).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from . import config, sweep
from .bootstrap import PORT_BASE, PORT_SPAN
from .config import Config, ConfigError
from .submit_follow import LogTail, outcome, report, wait_for
from .submit_job import EXIT_STOPPED, TrainingFailed, TrainJob

PROG = "python -m ddp_slurm.submit"
EXIT_USAGE = 2
# Options that are config keys: flag attribute -> dotted key.
FLAG_KEYS = {"nodes": "slurm.nodes", "gpus_per_node": "slurm.gpus_per_node", "tasks_per_node": "slurm.tasks_per_node",
             "cpus_per_task": "slurm.cpus_per_task", "partition": "slurm.partition", "account": "slurm.account",
             "qos": "slurm.qos", "constraint": "slurm.constraint", "time": "slurm.time_min",
             "signal_delay": "slurm.signal_delay_s", "name": "run.name"}


class UsageError(Exception):
    """Bad options: one line, exit 2, nothing submitted."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage over several lines; we want one
        raise UsageError(message)


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Submit the training job through submitit (Slurm, or this machine).",
                epilog="Defaults come from the config's slurm section; KEY=VALUE overrides are dotted config keys.")
    res = p.add_argument_group("resources (default: the config's slurm section)")
    res.add_argument("--nodes", type=_at_least(1))
    res.add_argument("--gpus-per-node", type=_at_least(0))
    res.add_argument("--tasks-per-node", type=_at_least(1), help="ranks per node (default: one per GPU, 1 without)")
    res.add_argument("--cpus-per-task", type=_at_least(1))
    res.add_argument("--partition")
    res.add_argument("--account")
    res.add_argument("--qos")
    res.add_argument("--constraint")
    res.add_argument("--time", type=_at_least(1), metavar="MIN", help="time limit in minutes")
    res.add_argument("--signal-delay", type=_at_least(0), metavar="S",
                     help="seconds before the time limit at which Slurm sends the stop signal")
    p.add_argument("--config", type=Path, help="YAML job config (default: the built-in sample defaults)")
    p.add_argument("--name", help="run name (run.name); for --sweep the sweep's directory name")
    p.add_argument("--cluster", choices=("slurm", "local", "debug"), default="slurm",
                   help="slurm (default), local: N processes on this machine, debug: in this process")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script, submit nothing")
    p.add_argument("--wait", action="store_true", help="follow the job, stream rank 0's log, exit with its status")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="one run per value, as a job array (repeat for a grid)")
    p.add_argument("--summary", type=Path, metavar="DIR", help="print a sweep's (or run's) final accuracies and exit")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return p


@dataclass
class Run:
    """One run to submit: its directory and the arguments of ``ddp_slurm.train`` that train it."""
    name: str
    run_dir: Path
    argv: list[str]
    point: tuple[str, ...] = ()  # the sweep's overrides for this run


@dataclass
class Plan:
    cfg: Config
    tasks_per_node: int
    runs: list[Run]
    root: Path  # the run directory, or the sweep's directory
    sweep: bool

    @property
    def folder(self) -> Path:
        return self.root / "submitit" / "%j"


def _quoted(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}"  # a JSON string is a YAML scalar: paths and names stay strings


def make_plan(args: argparse.Namespace) -> Plan:
    """Load and check every config, decide directories; raises ConfigError/UsageError. Touches no file."""
    cfg_path = Path(os.path.abspath(args.config)) if args.config else None
    base = list(args.overrides) + [_quoted(k, getattr(args, a)) for a, k in FLAG_KEYS.items()
                                   if getattr(args, a) is not None]
    cfg = config.load(cfg_path, base)
    tasks = cfg.slurm.tasks_per_node or cfg.slurm.gpus_per_node or 1
    if args.cluster != "slurm" and cfg.slurm.nodes > 1:
        raise UsageError(f"--nodes {cfg.slurm.nodes} needs Slurm, but --cluster {args.cluster} runs on this "
                         "machine only: use --nodes 1, or --cluster slurm on a Slurm login node")
    if args.cluster == "debug" and tasks > 1:
        raise UsageError(f"--cluster debug runs one task in this process, not {tasks}: use --cluster local for several")
    if args.dry_run and args.cluster != "slurm":
        raise UsageError(f"--dry-run prints the sbatch script of a Slurm job: drop --cluster {args.cluster}")
    root = Path(os.path.abspath(os.path.expanduser(cfg.run.output_root))) / cfg.run.name
    head = ["--config", str(cfg_path)] if cfg_path else []
    if args.sweep:
        if (root / "config.yaml").exists():
            raise UsageError(f"{root} is a run directory, not a sweep: choose another --name for the sweep")
        points = sweep.points(args.sweep)
        for key in (o.partition("=")[0] for o in points[0].overrides):
            if key.startswith(("slurm.", "run.")):
                raise UsageError(f"--sweep cannot vary {key}: the runs of one job array share slurm.* resources "
                                 "and each gets its own run.name")
        runs = [Run(p.name, root / p.name, head + base + list(p.overrides)
                    + [_quoted("run.output_root", str(root)), _quoted("run.name", p.name)], p.overrides)
                for p in points]
    else:
        runs = [Run(cfg.run.name, root, head + base + [_quoted("run.output_root", str(root.parent))])]
    world = cfg.slurm.nodes * tasks
    for run in runs:
        run_cfg = config.load(cfg_path, run.argv[len(head):])
        g = run_cfg.train.global_batch_size
        if g % world:
            raise ConfigError(f"train.global_batch_size={g} is not divisible by the world size {world} "
                              f"({cfg.slurm.nodes} node(s) x {tasks} task(s)): choose a multiple of {world}")
        saved = run.run_dir / "config.yaml"
        if saved.exists():
            diffs = config.incompatible_changes(config.read_resolved(saved), run_cfg)
            if diffs:
                raise UsageError(f"run directory {run.run_dir} holds a run with another config ({'; '.join(diffs)}): "
                                 "submit with the same settings to resume it, or choose another --name")
    return Plan(cfg, tasks, runs, root, bool(args.sweep))


def executor_parameters(plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
    """(AutoExecutor's generic parameters, Slurm-only ones), None values left out as AutoExecutor does."""
    s = plan.cfg.slurm
    generic = {"name": plan.cfg.run.name, "timeout_min": s.time_min, "nodes": s.nodes,
               "tasks_per_node": plan.tasks_per_node, "cpus_per_task": s.cpus_per_task,
               "gpus_per_node": s.gpus_per_node or None, "stderr_to_stdout": True}  # one log per rank
    # The signal is named explicitly (submitit would write its own USR_SIG); requeue is what lets
    # `scontrol requeue` and a preempting Slurm put the job back in the queue.
    extra = {"signal": f"{s.signal}@{s.signal_delay_s}", "requeue" if s.requeue else "no_requeue": True}
    specific = {"partition": s.partition, "account": s.account, "qos": s.qos, "constraint": s.constraint,
                "signal_delay_s": s.signal_delay_s, "additional_parameters": extra}
    drop = lambda d: {k: v for k, v in d.items() if v is not None}  # noqa: E731
    return drop(generic), drop(specific)


def sbatch_script(plan: Plan) -> str:
    """The exact script submitit's SlurmExecutor would give ``sbatch``, built by submitit's own code
    (parameter conversion, array line, ``srun`` command) on a machine that may have no Slurm."""
    from submitit.slurm.slurm import SlurmExecutor

    class ScriptOnly(SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:  # SlurmExecutor refuses to exist without srun on PATH
            return 2

    generic, specific = executor_parameters(plan)
    ex = ScriptOnly(plan.folder)
    params = ex._convert_parameters(generic)  # what AutoExecutor does with generic names
    params.update(specific)
    ex.update_parameters(**params)
    if plan.sweep:
        ex.parameters["map_count"] = len(plan.runs)  # as SlurmExecutor does for an array
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def _free_port(taken: set[int]) -> int:
    """A free TCP port below the ephemeral range (outgoing connections cannot take it meanwhile)."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(PORT_BASE, PORT_BASE + PORT_SPAN)
        with socket.socket() as s:
            if port in taken:
                continue
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError("no free TCP port found for the local rendezvous")


def submit(plan: Plan, cluster: str) -> list[Any]:
    """Submit; returns the submitit jobs (one per run). Submission errors raise RuntimeError (one line)."""
    import submitit

    generic, specific = executor_parameters(plan)
    ex = submitit.AutoExecutor(folder=plan.folder, cluster=cluster, slurm_max_num_timeout=plan.cfg.slurm.max_requeues)
    ex.update_parameters(**generic, **{f"slurm_{k}": v for k, v in specific.items()})
    ports: set[int] = set()
    fns = [TrainJob(run.argv, str(run.run_dir), plan.cfg.slurm.signal, os.getcwd(),
                    _free_port(ports) if cluster == "local" else 0) for run in plan.runs]
    captured = io.StringIO()  # submitit prints sbatch's stderr itself; we say it once, in one line
    try:
        with contextlib.redirect_stderr(captured):
            return ex.submit_array(fns) if plan.sweep else [ex.submit(fns[0])]
    except Exception as exc:
        text = (str(exc) or captured.getvalue() or type(exc).__name__).strip().splitlines()
        raise RuntimeError(f"{'sbatch' if cluster == 'slurm' else 'submission'} failed: {text[-1] if text else ''}") from None


def describe(plan: Plan, jobs: list[Any], cluster: str) -> None:
    """Job id, run directories and log paths, on stdout."""
    shape = f"{plan.cfg.slurm.nodes} node(s) x {plan.tasks_per_node} task(s)"
    job_id = str(jobs[0].job_id).split("_")[0]
    log = lambda job: job.task(0).paths.stdout  # noqa: E731  (rank 0; the others: _<rank>_log.out)
    if not plan.sweep:
        print(f"job: {job_id} ({cluster}: {shape})")
        print(f"run directory: {plan.runs[0].run_dir}")
        print(f"log of rank 0: {log(jobs[0])}")
        print(f"logs of all ranks: {str(log(jobs[0])).replace('_0_log.out', '_<rank>_log.out')}")
        return
    print(f"job: {job_id} ({cluster}: {len(jobs)} runs, each {shape})")
    print(f"sweep directory: {plan.root}")
    for job, run in zip(jobs, plan.runs):
        print(f"run {job.job_id}: {run.run_dir}  log: {log(job)}")
    print(f"summary: {PROG} --summary {plan.root}")


def follow(plan: Plan, jobs: list[Any], cluster: str) -> int:
    """``--wait``: stream rank 0's log (single run) or report runs as they end (sweep); training's status."""
    if cluster == "debug":  # runs now, in this process
        codes = []
        for job in jobs:
            try:
                job.result()
                codes.append(0)
            except SystemExit as exc:
                codes.append(exc.code if isinstance(exc.code, int) else EXIT_STOPPED)
            except TrainingFailed as exc:
                codes.append(exc.code)
        if plan.sweep:
            print(sweep.summary_text(plan.root))
        return next((c for c in codes if c), 0)
    if not plan.sweep:
        tail = LogTail(jobs[0].task(0).paths.stdout, sys.stdout)
        wait_for(jobs, cluster, on_poll=tail.pump)
        return report(outcome(jobs[0], plan.runs[0].run_dir, cluster))
    codes: dict[str, int] = {}

    def done(job: Any) -> None:
        run = plan.runs[jobs.index(job)]
        result = outcome(job, run.run_dir, cluster)
        codes[job.job_id] = result.code
        print(f"run {job.job_id} ({run.name}): {result.message}", flush=True)

    wait_for(jobs, cluster, on_done=done)
    print(sweep.summary_text(plan.root))
    return next((codes[j.job_id] for j in jobs if codes[j.job_id]), 0)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_intermixed_args(argv)
        if args.summary is not None:
            if args.overrides or args.sweep:
                raise UsageError("--summary DIR takes no overrides and no --sweep")
            print(sweep.summary_text(args.summary))
            return 0
        plan = make_plan(args)
        if args.cluster == "slurm" and not args.dry_run:
            missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
            if missing:
                raise UsageError(f"--cluster slurm but {' and '.join(missing)} not found on PATH: run this on a Slurm "
                                 "login node, or use --cluster local to run on this machine")
    except (UsageError, ConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # One stop signal everywhere: submitit reads it from here (at import) for its script and handlers.
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = plan.cfg.slurm.signal
    if args.dry_run:
        print(sbatch_script(plan), end="")
        return 0
    existed = plan.root.exists()
    try:
        jobs = submit(plan, args.cluster)
    except RuntimeError as exc:
        if not existed:  # nothing was submitted: leave no trace
            shutil.rmtree(plan.root, ignore_errors=True)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if plan.sweep:
        ids = [str(j.job_id) for j in jobs]
        sweep.write_manifest(plan.root, ids[0].split("_")[0] if args.cluster == "slurm" else ",".join(ids),
                             [sweep.Point(r.name, r.point) for r in plan.runs], list(args.overrides))
    describe(plan, jobs, args.cluster)
    if not (args.wait or args.cluster == "debug"):
        return 0
    sys.stdout.flush()
    try:
        return follow(plan, jobs, args.cluster)
    except KeyboardInterrupt:
        print(f"\nstopped following; the job keeps running (log: {jobs[0].task(0).paths.stdout})", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
