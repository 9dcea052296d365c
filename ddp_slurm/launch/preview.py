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

from ddp_slurm import taskref

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
    lo, hi = s.node_span
    world = "-".join(str(n * plan.tasks_per_node) for n in sorted({lo, hi}))
    gpus = f"{s.gpus_per_node} GPU(s) per node" if s.gpus_per_node else "no GPU (slurm.gpus_per_node=0: a CPU job)"
    asked = [
        f"{s.nodes_text} node(s)",
        f"{plan.tasks_per_node} task(s) per node",
        f"{s.cpus_per_task} CPU(s) per task",
        gpus,
        f"time {s.time}",
        f"partition {s.partition or '(the default)'}",
    ]
    asked += [f"{k} {v}" for k, v in (("account", s.account), ("qos", s.qos), ("mem", s.mem)) if v]
    lines = [
        f"world size: {world} ({s.nodes_text} node(s) x {plan.tasks_per_node} rank(s) per node)",
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


MIN_SAMPLES_PER_GPU = 16
"""Below this per-rank batch a GPU spends each step mostly waiting: its compute is a few kernels, and the
all-reduce of every gradient costs the same whatever the batch."""


def misfit_warnings(plan: Plan) -> list[str]:
    """One line per misfit a user would otherwise learn about after waiting in the queue: a per-GPU batch
    too small to keep a GPU busy, fewer CPUs per rank than the data loader's workers need, and no
    partition, account or memory asked for (the cluster's defaults then decide). The dry run imports no
    task, so the dataset's size is not known here: training checks it against the batch before any work."""
    s, train = plan.cfg.slurm, plan.cfg.train
    world = s.nodes * plan.tasks_per_node
    found = []
    per_rank = train.global_batch_size // world if world else 0
    if s.gpus_per_node and per_rank < MIN_SAMPLES_PER_GPU:
        found.append(
            f"warning: {world} GPU ranks share train.global_batch_size={train.global_batch_size}: {per_rank} "
            f"samples per GPU per step, too few to keep a GPU busy (each step waits on an all-reduce of every "
            f"gradient); raise train.global_batch_size to {MIN_SAMPLES_PER_GPU * world} or more, or ask for fewer GPUs"
        )
    # The built-in task keeps its data in memory (no loader workers); any other task may use a Dataset.
    if plan.cfg.task != taskref.DEFAULT and train.workers and s.cpus_per_task < train.workers + 1:
        found.append(
            f"warning: slurm.cpus_per_task={s.cpus_per_task} per rank, but a task whose data is a Dataset runs "
            f"train.workers={train.workers} loader processes beside each rank: ask for --cpus-per-task "
            f"{train.workers + 1} or more, or set train.workers={max(s.cpus_per_task - 1, 0)}"
        )
    for key, flag, why in (
        ("partition", "--partition", "the cluster's default partition (often a small or debug one)"),
        ("account", "--account", "your default account (some clusters refuse a job without one)"),
        ("mem", "--mem", "the partition's default memory per node (often a few GB)"),
    ):
        if not getattr(s, key):
            found.append(f"warning: no slurm.{key} set: the job gets {why}; set {flag} if that is not what you want")
    return found


def warnings(plan: Plan) -> list[str]:
    """Every warning about a submission, one line each, said before it queues (dry run or not)."""
    gpu = gpu_warning(plan)
    return ([gpu] if gpu else []) + misfit_warnings(plan)


def print_dry_run(plan: Plan, script: str) -> None:
    """The summary and any warning on stderr, the script alone on stdout (``--dry-run > job.sh``)."""
    sys.stderr.write(summary(plan))
    for warning in warnings(plan):
        sys.stderr.write(f"# {warning}\n")
    sys.stdout.write(script)
