"""What a submission asks for, in words: ``submit --dry-run``'s summary and the GPU check of the partition.

Why: submitit's script runs ``python -m submitit.core._submit FOLDER`` (a pickle), which tells a reader
nothing about the training; and ``slurm.gpus_per_node`` defaults to 0, so ``submit --nodes 4`` on a GPU
cluster quietly asks for four CPU-only allocations. The summary says the training command each rank
runs, the world size, the resources and the resolved config; ``gpu_warning`` compares the GPUs asked
for with the GRES that ``sinfo`` reports for the partition's nodes.

A warning, not ``slurm.gpus_per_node=auto``: an explicit number keeps what a job asks for in its
config.yaml and its script, the same on every requeue and resubmission; a partition of mixed nodes
has no single answer; and a CPU job on a GPU partition is sometimes what one wants (a data job, a
test). The warning names the number to add.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddp_slurm.launch.plan import Plan

_GPU = re.compile(r"(?:^|,)gpu(?::[A-Za-z0-9_.-]+)?:(\d+)")


def partition_gpus(partition: str | None, timeout_s: float = 10.0) -> tuple[int, str] | None:
    """(most GPUs on one node, sinfo's GRES text) of ``partition`` (None: the default one), or None when
    sinfo is missing or fails. Reads ``sinfo --noheader --format=%G``: ``gpu:2``, ``gpu:a100:4(S:0-1)``."""
    if shutil.which("sinfo") is None:
        return None
    cmd = ["sinfo", "--noheader", "--format=%G"] + (["--partition", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    counts = [int(m) for line in lines for m in _GPU.findall(re.sub(r"\([^)]*\)", "", line))]
    return (max(counts), ",".join(lines)) if counts else (0, ",".join(lines))


def gpu_warning(plan: Plan) -> str | None:
    """One line when the job asks for no GPU although the partition's nodes have some."""
    s = plan.cfg.slurm
    if s.gpus_per_node:
        return None
    found = partition_gpus(s.partition)
    if found is None or found[0] == 0:
        return None
    where = f"partition {s.partition}" if s.partition else "the default partition"
    return (
        f"warning: the nodes of {where} have GPUs (sinfo: {found[1]}), but this job asks for none "
        f"(slurm.gpus_per_node=0): a CPU job; add --gpus-per-node {found[0]} to train on them"
    )


def summary(plan: Plan) -> str:
    """``--dry-run``'s account of the job, as ``#`` lines: command, world size, resources, config."""
    import yaml

    s = plan.cfg.slurm
    world = s.nodes * plan.tasks_per_node
    gpus = f"{s.gpus_per_node} GPU(s) per node" if s.gpus_per_node else "no GPU (slurm.gpus_per_node=0: a CPU job)"
    asked = [
        f"{s.nodes} node(s)",
        f"{plan.tasks_per_node} task(s) per node",
        f"{s.cpus_per_task} CPU(s) per task",
        gpus,
        f"time {s.time}",
        f"partition {s.partition or '(the default)'}",
    ]
    asked += [f"{k} {v}" for k, v in (("account", s.account), ("qos", s.qos), ("mem", s.mem)) if v]
    lines = [
        f"world size: {world} ({s.nodes} node(s) x {plan.tasks_per_node} rank(s) per node)",
        "resources: " + ", ".join(asked),
        f"stop signal: {s.signal} {s.signal_delay_s} s before the time limit; requeue {'on' if s.requeue else 'off'}",
    ]
    for run in plan.runs:
        lines.append(f"each rank runs (run directory {run.run_dir}):")
        lines.append("  python -m ddp_slurm.train " + " ".join(run.argv))
    if not plan.sweep:
        cfg = plan.runs[0].cfg  # what the ranks will resolve: the run directory's config.yaml
        lines.append("config (written to the run directory's config.yaml):")
        lines += ["  " + line for line in yaml.safe_dump(cfg.to_dict(), sort_keys=False).splitlines()]
        if not cfg.resolved:
            lines.append(
                f"  (the task's own sections as given, not checked: a dry run imports no task; the job imports "
                f"{cfg.task} and fills in its defaults)"
            )
    lines.append("the sbatch script (on stdout; submitit starts the ranks from a pickle of the command above):")
    return "".join(f"# {line}\n" for line in lines)


def print_dry_run(plan: Plan, script: str) -> None:
    """The summary and any warning on stderr, the script alone on stdout (``--dry-run > job.sh``)."""
    sys.stderr.write(summary(plan))
    warning = gpu_warning(plan)
    if warning:
        sys.stderr.write(f"# {warning}\n")
    sys.stdout.write(script)
