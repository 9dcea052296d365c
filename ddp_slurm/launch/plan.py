"""What ``python -m ddp_slurm.submit`` submits, and how: the checked plan, submitit's executor, the script.

``make_plan`` loads and checks every run's config before anything touches the disk or the queue
(bad options: ``UsageError``/``ConfigError``, exit 2). The config is read once; each run's config is
derived from it (``config.with_overrides``). Its task is imported once, for a real submission only
(its keys checked before the job queues); a dry run imports none, and an existing run directory's
config.yaml is compared with ``config.changes_from``, which never imports the task it names. ``executor_parameters`` is the one place that
turns the config's ``slurm`` section into submitit parameters; both the real submission (an
``AutoExecutor``) and ``--dry-run`` (``sbatch_script``, submitit's own text without submitting) use it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_slurm import config, safefs, slurm_time
from ddp_slurm.config import Config
from ddp_slurm.distributed.env import free_port
from ddp_slurm.errors import UsageError  # bad options: one line, exit 2, nothing submitted
from ddp_slurm.launch import flags, sweep
from ddp_slurm.launch.job import TrainJob
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.slurmjob import badnodes
from ddp_slurm.train import runname


def script_safe(what: str, text: str, fix: str) -> str:
    """``text`` unchanged, or UsageError: the one check of every string submit writes into the job script
    (the run directory, the config file, ``--sbatch`` and ``--setup``). A newline there would end an
    ``#SBATCH`` line early: the rest becomes a shell command and sbatch ignores every later ``#SBATCH`` line
    (the stop signal, ``--requeue``, ``--time``); other control characters are never meant either."""
    if config.CONTROL.search(text):
        raise UsageError(f"{what} {text!r} holds control characters (a newline, tab, escape, ...): {fix}")
    return text


@dataclass
class PlannedRun:
    """One run to submit: its directory and the arguments of ``ddp_slurm.train`` that train it."""

    name: str
    run_dir: Path
    argv: list[str]
    cfg: Config  # what the ranks will resolve from ``argv`` (the task unchecked in a dry run)
    point: tuple[str, ...] = ()  # the sweep's overrides for this run


@dataclass
class Plan:
    cfg: Config
    tasks_per_node: int
    runs: list[PlannedRun]
    root: Path  # the run directory, or the sweep's directory
    sweep: bool
    sbatch: dict[str, Any] = field(default_factory=dict)  # --sbatch KEY=VALUE: more sbatch options
    setup: list[str] = field(default_factory=list)  # --setup LINE: shell lines before srun
    exclude: list[str] = field(default_factory=list)  # hosts the run lost a rank on (slurmjob/badnodes.py)

    @property
    def folder(self) -> Path:
        return RunPaths(self.root).submitit / "%j"


def _quoted(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}"  # a JSON string is a YAML scalar: paths and names stay strings


def make_plan(args: argparse.Namespace) -> Plan:
    """Load and check every config, decide directories; raises ConfigError/UsageError. Touches no file."""
    cfg_path = Path(os.path.abspath(args.config)) if args.config else None
    base = list(args.overrides) + flags.overrides(args)
    if args.name is not None:
        base.append(_quoted("run.name", args.name))
    cfg = config.load(cfg_path, base, resolve=False)  # the one read of the config
    if cfg.run.name is None:  # named now: every requeue and resubmission of the job finds it again
        base.append(_quoted("run.name", runname.new_name(cfg)))
        cfg = config.with_overrides(cfg, base[-1:])
    tasks = cfg.slurm.tasks_per_node or cfg.slurm.gpus_per_node or 1
    if args.cluster != "slurm" and cfg.slurm.nodes > 1:
        raise UsageError(
            f"--nodes {cfg.slurm.nodes_text} needs Slurm, but --cluster {args.cluster} runs on this "
            "machine only: use --nodes 1, or --cluster slurm on a Slurm login node"
        )
    if args.cluster == "debug" and tasks > 1:
        raise UsageError(f"--cluster debug runs one task in this process, not {tasks}: use --cluster local for several")
    if args.dry_run and args.cluster != "slurm":
        raise UsageError(f"--dry-run prints the sbatch script of a Slurm job: drop --cluster {args.cluster}")
    root = Path(os.path.abspath(os.path.expanduser(cfg.run.output_root))) / cfg.run.name
    # The run directory (from the working directory too) becomes #SBATCH lines and file names.
    for what, text in (("the run directory", str(root)), ("the config file", str(cfg_path or ""))):
        script_safe(what, text, "run from a directory without them")
    for line in getattr(args, "setup", None) or []:
        script_safe("--setup", line, "give each shell line as its own --setup")
    if not args.dry_run:  # the user's own task, imported once: its keys are checked before the job queues
        cfg = config.resolve(cfg)
    head = ["--config", str(cfg_path)] if cfg_path else []
    runs = _runs(args, cfg, root, head, base)
    for run in runs:
        config.check_node_range(run.cfg, tasks)
        saved = RunPaths(run.run_dir).config
        if os.path.lexists(saved):
            diffs = _changes(saved, run.cfg)
            if diffs:
                raise UsageError(
                    f"run directory {run.run_dir} holds a run with another config ({'; '.join(diffs)}): "
                    f"submit with the same settings to resume it (`--config {saved}` reuses them), "
                    "or choose another --name"
                )
    limit_min = slurm_time.minutes(cfg.slurm.time)
    if limit_min is None:
        raise UsageError(
            f"slurm.time={cfg.slurm.time} has no end, so Slurm never sends the stop signal before it: "
            "give a finite --time (e.g. 2-00:00:00)"
        )
    if cfg.slurm.signal_delay_s >= limit_min * 60:
        raise UsageError(
            f"--signal-delay {cfg.slurm.signal_delay_s} s is not shorter than --time {cfg.slurm.time} "
            f"({limit_min} min): the stop signal would come before the job could train; lower --signal-delay "
            "or raise --time"
        )
    extra = parse_sbatch_options(getattr(args, "sbatch", None) or [])
    setup = list(getattr(args, "setup", None) or [])
    return Plan(
        cfg,
        tasks,
        runs,
        root,
        bool(args.sweep),
        extra,
        setup,
        [] if args.sweep else _lost(root, cfg.slurm.exclude_slow),
    )


def _runs(args: argparse.Namespace, cfg: Config, root: Path, head: list[str], base: list[str]) -> list[PlannedRun]:
    """The runs to submit: one, or one per point of the sweep, each with its arguments and its config."""
    if not args.sweep:
        where = [_quoted("run.output_root", str(root.parent))]
        return [PlannedRun(cfg.run.name, root, head + base + where, config.with_overrides(cfg, where))]
    if os.path.lexists(RunPaths(root).config):
        raise UsageError(f"{root} is a run directory, not a sweep: choose another --name for the sweep")
    points = sweep.points(args.sweep)
    for key in (o.partition("=")[0] for o in points[0].overrides):
        if key.startswith(("slurm.", "run.")):
            raise UsageError(
                f"--sweep cannot vary {key}: the runs of one job array share slurm.* resources "
                "and each gets its own run.name"
            )
    runs = []
    for p in points:
        own = list(p.overrides) + [_quoted("run.output_root", str(root)), _quoted("run.name", p.name)]
        runs.append(PlannedRun(p.name, root / p.name, head + base + own, config.with_overrides(cfg, own), p.overrides))
    return runs


def _changes(saved: Path, run_cfg: Config) -> list[str]:
    """What differs between a run directory's config.yaml and the config submitted for it, importing nothing
    it names; a damaged file is one line."""
    data = config.read_saved(saved)
    try:
        return config.changes_from(data, run_cfg, str(saved))
    except config.ConfigError as exc:
        raise config.damaged(exc) from None


def _lost(run_dir: Path, slow: bool) -> list[str]:
    """The hosts a run lost a rank on (and, with ``slow``: ``slurm.exclude_slow``, those it named slow), to be
    excluded from its resubmission; UsageError for a lost_nodes that is not a file this program wrote (nothing
    from it may reach sbatch)."""
    try:
        return badnodes.excluded(run_dir, slow=slow)
    except (safefs.UnsafePath, OSError) as exc:
        raise UsageError(f"cannot read the nodes this run lost: {exc}") from None


def parse_sbatch_options(items: list[str]) -> dict[str, Any]:
    """``["gres=gpu:a100:4", "--mail-type=END", "hint=nomultithread"]`` -> submitit's
    ``additional_parameters`` (underscored keys; a bare ``KEY`` is a flag). Raises UsageError."""
    out: dict[str, Any] = {}
    for item in items:
        script_safe("--sbatch", item, "give each sbatch option as its own --sbatch KEY=VALUE, on one line")
        key, sep, value = item.strip().lstrip("-").partition("=")
        name = key.strip().replace("-", "_")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            raise UsageError(f"--sbatch {item!r}: expected KEY=VALUE with an sbatch long option, e.g. mail-type=END")
        if name in flags.OWN_OPTIONS:
            raise UsageError(
                f"--sbatch {item!r}: submit sets --{key.strip()} itself; use {flags.OWN_OPTIONS[name]} instead"
            )
        if sep and not value:
            raise UsageError(f"--sbatch {item!r}: no value after '='; write {key}=VALUE, or {key} for a flag")
        out[name] = value if sep else True
    return out


# A rank that fails ends the step at once (as in sbatch/*.sh): the others would otherwise hold the allocation
# in a collective or a rendezvous until a timeout, or until the job's time limit.
SRUN_ARGS = ["--kill-on-bad-exit=1"]


def executor_parameters(plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
    """(AutoExecutor's generic parameters, Slurm-only ones), None values left out as AutoExecutor does."""
    s = plan.cfg.slurm
    generic = {
        "name": plan.cfg.run.name,
        "timeout_min": slurm_time.minutes(s.time),
        "nodes": s.nodes,
        "tasks_per_node": plan.tasks_per_node,
        "cpus_per_task": s.cpus_per_task,
        "gpus_per_node": s.gpus_per_node or None,
        "stderr_to_stdout": True,
    }  # one log per rank
    # The signal is named explicitly (submitit would write its own USR_SIG); requeue is what lets
    # `scontrol requeue` and a preempting Slurm put the job back in the queue.
    extra = {**plan.sbatch, "signal": f"{s.signal}@{s.signal_delay_s}", "requeue" if s.requeue else "no_requeue": True}
    if s.min_nodes and s.min_nodes < s.nodes:  # submitit types nodes as an int: the range is sbatch's own option
        extra["nodes"] = s.nodes_text
    if plan.exclude:  # nodes this run lost a rank on (slurmjob/badnodes.py): a resubmission does not ask for them again
        extra["exclude"] = ",".join(filter(None, [str(plan.sbatch.get("exclude") or ""), *plan.exclude]))
    specific = {
        "partition": s.partition,
        "account": s.account,
        "qos": s.qos,
        "constraint": s.constraint,
        "mem": s.mem,
        "mem_per_gpu": s.mem_per_gpu,
        "exclusive": True if s.exclusive else None,
        "setup": [*plan.setup, *supervised(plan, extra)] or None,
        "signal_delay_s": s.signal_delay_s,
        "srun_args": SRUN_ARGS,
        "additional_parameters": extra,
    }
    drop = lambda d: {k: v for k, v in d.items() if v is not None}  # noqa: E731
    return drop(generic), drop(specific)


def supervised(plan: Plan, extra: dict[str, Any]) -> list[str]:
    """The job keeps its allocation when a node fails (``--no-kill``), and its ``srun`` line runs through the
    supervisor (``launch/supervise.py``): a shell function named ``srun``, defined after every ``--setup`` line,
    so that submitit's own command is what each launch runs. A sweep's tasks and ``slurm.restarts=0`` keep
    submitit's plain ``srun`` (a lost node requeues the job)."""
    if plan.sweep or not plan.cfg.slurm.restarts:
        return []
    extra["no_kill"] = True
    train = shlex.quote(shlex.join(plan.runs[0].argv))
    line = f'srun() {{ {shlex.quote(sys.executable)} -m ddp_slurm.launch.supervise --submitit {train} -- "$@"; }}'
    why = (
        "# srun below runs through ddp_slurm's supervisor: it relaunches the step on the nodes left when one is "
        "lost (--no-kill keeps the allocation), at most slurm.restarts times"
    )
    return [why, script_safe("the training's arguments", line, "remove control characters from the overrides")]


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


def submit(plan: Plan, cluster: str) -> list[Any]:
    """Submit; returns the submitit jobs (one per run). Submission errors raise RuntimeError (one line)."""
    import submitit

    generic, specific = executor_parameters(plan)
    ex = submitit.AutoExecutor(folder=plan.folder, cluster=cluster, slurm_max_num_timeout=plan.cfg.slurm.max_requeues)
    ex.update_parameters(**generic, **{f"slurm_{k}": v for k, v in specific.items()})
    ports: set[int] = set()
    fns = [
        TrainJob(
            run.argv,
            str(run.run_dir),
            plan.cfg.slurm.signal,
            os.getcwd(),
            free_port(ports) if cluster == "local" else 0,
        )
        for run in plan.runs
    ]
    captured = io.StringIO()  # submitit prints sbatch's stderr itself; we say it once, in one line
    try:
        with contextlib.redirect_stderr(captured):
            return ex.submit_array(fns) if plan.sweep else [ex.submit(fns[0])]
    except Exception as exc:
        text = (str(exc) or captured.getvalue() or type(exc).__name__).strip().splitlines()
        what = "sbatch" if cluster == "slurm" else "submission"
        raise RuntimeError(f"{what} failed: {text[-1] if text else 'no reason given'}") from None
