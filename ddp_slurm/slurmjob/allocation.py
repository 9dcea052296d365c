"""Inside an sbatch job: which ``slurm.*`` settings the allocation ignores, and a stop signal that would kill.

``slurm.*`` describes what ``submit`` asks Slurm for. Under ``sbatch script.sh`` the allocation already
exists: ``slurm.nodes=2`` in a 4-node job changes nothing. :func:`check_allocation` compares the config
with the job (``scontrol show job -o``, the ``SLURM_*`` variables and the batch script's ``#SBATCH``
lines) and returns one warning line naming every key that differs and what the job has instead.

One difference is an error, because it loses work: a ``--signal`` other than ``slurm.signal``. Training
catches only ``slurm.signal`` (and SIGTERM), so Slurm's warning before the time limit, say SIGUSR1,
would kill every rank instead of making them checkpoint. A ``B:`` signal (batch shell only) never
reaches the ranks at all. Both raise :class:`~ddp_slurm.config.ConfigError` (exit 2) with the fix.

Where the job's ``--signal`` comes from: Slurm's ``SubmitLine`` when ``scontrol`` shows it (the sbatch
command line), else ``SBATCH_SIGNAL`` in the environment, else the script's ``#SBATCH --signal`` line.
Slurm 22.05 does not show the command line, so there a ``--signal`` given on it goes unseen and the
script's line is taken; the messages say which source they read.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddp_slurm import slurm_time
from ddp_slurm.config import Config, ConfigError
from ddp_slurm.slurmjob import slurm
from ddp_slurm.slurmjob.jobinfo import allocation_values, job_signal, mb, parse_job


def _differs(key: str, wanted: object, have: object) -> bool:
    if key == "time":
        return slurm_time.minutes(str(wanted)) != have
    if key in ("mem", "mem_per_gpu"):
        return mb(str(wanted)) != have
    return wanted != have


def _shown(key: str, value: object) -> str:
    if isinstance(value, str):  # as the config spells it
        return value
    if key == "time":
        return slurm_time.format_minutes(value)  # type: ignore[arg-type]
    if key in ("mem", "mem_per_gpu"):
        return f"{value}M"
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_allocation(
    cfg: Config, environ: Mapping[str, str], job_text: str, batch_script: str | None = None
) -> list[str]:
    """Warnings (at most one line about ignored keys, one about the signal delay, one about requeue)
    for a run inside the Slurm job described by ``job_text`` (``scontrol show job -o``); raises
    ConfigError when the job's stop signal would kill the ranks. Outside a Slurm job: no warnings."""
    if not environ.get("SLURM_JOB_ID"):
        return []
    fields = parse_job(job_text)
    s = cfg.slurm
    warnings: list[str] = []
    have = allocation_values(fields, environ)
    ignored = []
    # Under `srun torchrun` a Slurm task is a torchrun agent, not a rank: its task and CPU counts are per node.
    agents = "TORCHELASTIC_RUN_ID" in environ
    for key in (
        "nodes",
        "tasks_per_node",
        "gpus_per_node",
        "cpus_per_task",
        "partition",
        "account",
        "qos",
        "constraint",
        "time",
        "mem",
        "mem_per_gpu",
        "exclusive",
    ):
        wanted = getattr(s, key)
        if agents and key in ("tasks_per_node", "cpus_per_task"):
            continue
        if wanted is None or key not in have or (key == "exclusive" and not wanted):
            continue  # not asked for, or not known for this job
        if key == "nodes" and key in have and s.node_span[0] <= have[key] <= wanted:
            continue  # a count in the range asked for (slurm.min_nodes)
        if _differs(key, wanted, have[key]):
            ignored.append(f"slurm.{key}={_shown(key, wanted)} (the job has {_shown(key, have[key])})")
    if ignored:
        warnings.append(
            f"inside Slurm job {environ['SLURM_JOB_ID']} these settings have no effect, the allocation decides: "
            f"{', '.join(ignored)}; ask sbatch for them (#SBATCH lines or its command line), or use submit"
        )
    sig = job_signal(fields, environ, batch_script)
    if sig is None:
        warnings.append(
            f"Slurm job {environ['SLURM_JOB_ID']} asked for no --signal: at the time limit the ranks get only "
            f"SIGTERM and a short grace; add #SBATCH --signal={s.signal}@{s.signal_delay_s} to checkpoint in time"
        )
        return warnings
    fix = (
        f"run with slurm.signal={sig.name} to match the job, or change --signal to {s.signal}@{sig.delay_s} in {sig.source}"
        if sig.name in ("USR1", "USR2", "TERM", "INT", "HUP", "URG")
        else f"change --signal to {s.signal}@{sig.delay_s} in {sig.source}"
    )
    if sig.batch_only:
        raise ConfigError(
            f"the job's --signal={sig.text} ({sig.source}) goes to the batch shell only (B:), never to the ranks: "
            f"they cannot checkpoint before the time limit; drop 'B:' ({s.signal}@{sig.delay_s})"
        )
    if sig.name != s.signal:
        raise ConfigError(
            f"the job's --signal={sig.text} ({sig.source}) is not slurm.signal={s.signal}: SIG{sig.name} would "
            f"kill every rank instead of making it checkpoint; {fix}"
        )
    if sig.delay_s != s.signal_delay_s:
        warnings.append(
            f"slurm.signal_delay_s={s.signal_delay_s} has no effect inside Slurm job {environ['SLURM_JOB_ID']}: "
            f"its --signal={sig.text} ({sig.source}) sends {sig.name} {sig.delay_s} s before the time limit"
        )
    if fields.get("Requeue") == "0" and s.requeue:
        warnings.append(
            f"Slurm job {environ['SLURM_JOB_ID']} was submitted with --no-requeue: a stop signal checkpoints, "
            "but the job cannot be requeued (add #SBATCH --requeue, or slurm.requeue=false to silence this)"
        )
    return warnings


def _scontrol(*args: str) -> str | None:
    ok, out = slurm.scontrol(*args, timeout_s=30)
    return out if ok else None


def check_current(cfg: Config, environ: Mapping[str, str]) -> list[str]:
    """:func:`check_allocation` for the job this process runs in (asks ``scontrol``; one call per job is
    enough: call it on rank 0 only). Without Slurm or ``scontrol``, what the environment tells."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return []
    job_text = _scontrol("show", "job", "-o", job_id) or ""
    script = _scontrol("write", "batch_script", job_id, "-")
    return check_allocation(cfg, environ, job_text, script)


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_slurm.slurmjob.allocation [--config FILE] [KEY=VALUE ...]``: the check on its own,
    inside a job (``srun -N1 -n1 python -m ddp_slurm.slurmjob.allocation ...`` or in the batch script)."""
    import argparse
    import logging
    import os
    import sys

    from ddp_slurm import config
    from ddp_slurm.exitcodes import EXIT_OK, EXIT_USAGE

    parser = argparse.ArgumentParser(
        prog="python -m ddp_slurm.slurmjob.allocation",
        description="Inside a Slurm job: slurm.* settings the allocation ignores, and a --signal training would not catch.",
    )
    parser.add_argument("--config", help="YAML job config, as given to ddp_slurm.train")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    try:
        cfg = config.load(args.config, args.overrides)
        warnings = check_current(cfg, os.environ)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    if not os.environ.get("SLURM_JOB_ID"):
        print("not inside a Slurm job: nothing to check", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
