"""``python -m ddp_slurm.submit [options] [KEY=VALUE ...]``: the training job through submitit.

The same training as ``python -m ddp_slurm.train`` (same config, overrides, run directory, exit
codes), submitted from Python with a submitit ``AutoExecutor``: one ``srun`` task per rank on Slurm,
or ``--cluster local`` (N processes on this machine) / ``--cluster debug`` (in this process).

Options default to the config's ``slurm`` section and, when given, become config overrides
(``--nodes 4`` is ``slurm.nodes=4``), so the run directory's config.yaml records what was asked; they
are made from that section's fields (``flags.py``). The config is read once (``plan.make_plan``); the
task it names is imported only to submit (its keys checked before the job queues), never for
``--dry-run`` or ``--summary``, and never the task a run directory's config.yaml names.
The job asks for ``--signal=<slurm.signal>@<signal_delay_s>`` and ``--requeue``; training's own
signal handling stops every rank at the same step, checkpoints, and rank 0 requeues the job once (the
options: ``plan.executor_parameters``; the requeue: ``train/loop.py``'s ``stop_on_signal``). ``--sweep KEY=V1,V2``
submits a job array, one run per value (see ``sweep``).

Exit status: 0 submitted (with ``--wait``: finished); 2 bad options or config, nothing submitted and
no run directory created; with ``--wait``, training's status otherwise (1 failure, 3 requeue cap,
75 stopped with a checkpoint and not requeued).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any, NoReturn

from ddp_slurm import safefs
from ddp_slurm.config import ConfigError
from ddp_slurm.exitcodes import EXIT_USAGE
from ddp_slurm.launch import flags, preview, sweep
from ddp_slurm.launch.follow import STOPPED_MESSAGE, LogTail, Outcome, finished_message, outcome, report, wait_for
from ddp_slurm.launch.job import EXIT_STOPPED, TrainingFailed
from ddp_slurm.launch.plan import Plan, UsageError, make_plan, sbatch_script, submit
from ddp_slurm.tools import sweeps

PROG = "python -m ddp_slurm.submit"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage over several lines; we want one
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Submit the training job through submitit (Slurm, or this machine).",
        epilog="Defaults come from the config's slurm section; KEY=VALUE overrides are dotted config keys.",
    )
    res = p.add_argument_group("resources (default: the config's slurm section)")
    flags.add_to(res)  # one per slurm.* key, from the config's own fields (launch/flags.py)
    res.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sbatch option, e.g. --sbatch mail-type=END (repeat; a bare KEY is a flag)",
    )
    res.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="a shell line the job runs before srun, e.g. --setup 'module load cuda/12.4' (repeat)",
    )
    p.add_argument("--config", type=Path, help="YAML job config (default: the built-in sample defaults)")
    p.add_argument("--name", help="run name (run.name); for --sweep the sweep's directory name")
    p.add_argument(
        "--cluster",
        choices=("slurm", "local", "debug"),
        default="slurm",
        help="slurm (default), local: N processes on this machine, debug: in this process",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would run (command, world size, resources, config) and the sbatch script; submit nothing",
    )
    p.add_argument("--wait", action="store_true", help="follow the job, stream rank 0's log, exit with its status")
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="one run per value, as a job array (repeat for a grid)",
    )
    p.add_argument("--summary", type=Path, metavar="DIR", help="print a sweep's (or run's) final accuracies and exit")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return p


def describe(plan: Plan, jobs: list[Any], cluster: str) -> None:
    """Job id, run directories and log paths, on stdout."""
    shape = f"{plan.cfg.slurm.nodes_text} node(s) x {plan.tasks_per_node} task(s)"
    ids = [str(job.job_id) for job in jobs]
    job_id = ids[0].split("_")[0] if plan.sweep and cluster == "slurm" else ",".join(ids)  # an array: its id
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
    if cluster == "debug":  # runs now, in this process (submitit opens pdb on an exception)
        codes = []
        for job, run in zip(jobs, plan.runs):
            try:
                result = Outcome(0, finished_message(job.result()), [])
            except SystemExit:  # TrainJob's way of saying "stopped with a checkpoint"
                result = Outcome(EXIT_STOPPED, STOPPED_MESSAGE.format(step=sweep.summarize(run.run_dir).step), [])
            except TrainingFailed as exc:
                result = Outcome(exc.code, f"rank 0 failed: {exc}", [])
            codes.append(report(result))
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
                raise UsageError(
                    f"--cluster slurm but {' and '.join(missing)} not found on PATH: run this on a Slurm "
                    "login node, or use --cluster local to run on this machine"
                )
    except (UsageError, ConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # One stop signal everywhere: submitit reads it from here (at import) for its script and handlers.
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = plan.cfg.slurm.signal
    if args.dry_run:
        preview.print_dry_run(plan, sbatch_script(plan))
        return 0
    if args.cluster == "slurm":
        for warning in preview.warnings(plan):  # a misfit is said once, before the job queues
            print(f"{PROG}: {warning}", file=sys.stderr)
    # submitit's folders and result files: not writable by the group, so that --wait may unpickle them.
    safefs.tighten_umask(plan.cfg.run.shared)
    new = next((d for d in reversed([plan.root, *plan.root.parents]) if not d.exists()), None)
    try:
        jobs = submit(plan, args.cluster)
    except RuntimeError as exc:
        if new is not None:  # nothing was submitted: leave no trace (the log folder made the run directory)
            shutil.rmtree(new, ignore_errors=True)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if plan.sweep:
        ids = [str(j.job_id) for j in jobs]
        job_id = ids[0].split("_")[0] if args.cluster == "slurm" else ",".join(ids)
        points = [sweep.Point(r.name, r.point) for r in plan.runs]
        sweeps.write(plan.root, sweep.manifest(job_id, points, list(args.overrides)), plan.cfg.run.shared)
    describe(plan, jobs, args.cluster)
    if not (args.wait or args.cluster == "debug"):
        return 0
    sys.stdout.flush()
    try:
        return follow(plan, jobs, args.cluster)
    except KeyboardInterrupt:  # a local job shares this terminal: Ctrl-C reached its processes too
        what = "the job keeps running" if args.cluster == "slurm" else "the local job was interrupted too"
        print(f"\nstopped following; {what} (log: {jobs[0].task(0).paths.stdout})", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
