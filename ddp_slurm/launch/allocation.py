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

import re
import shlex
import signal as _signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from ddp_slurm import slurm_time
from ddp_slurm.config import Config, ConfigError

_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=(.*?)(?=\s+[A-Za-z][\w/:]*=|\s*$)")
_SIGNAL = re.compile(r"^(?:(?P<where>[RB]+):)?(?P<sig>[A-Za-z0-9]+)(?:@(?P<delay>\d+))?$")


def parse_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` (or its multi-line form) as ``{field: value}``; ``(null)`` becomes ''."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        for key, value in _FIELD.findall(line):
            fields[key] = "" if value.strip() == "(null)" else value.strip()
    return fields


@dataclass(frozen=True)
class JobSignal:
    """A parsed ``--signal=[R|B:]SIG[@DELAY]``; ``source`` says where it was read."""

    name: str  # USR2, TERM, ... (no SIG prefix)
    delay_s: int
    batch_only: bool
    source: str
    text: str


def parse_signal_spec(spec: str, source: str) -> JobSignal:
    m = _SIGNAL.match(spec.strip())
    if not m:
        raise ConfigError(f"the job's --signal={spec} ({source}) is not Slurm's [B:]SIG[@SECONDS] form")
    sig = m["sig"].upper()
    if sig.isdigit():
        try:
            sig = _signal.Signals(int(sig)).name
        except ValueError:
            raise ConfigError(f"the job's --signal={spec} ({source}) names no signal") from None
    sig = sig.removeprefix("SIG")
    # Slurm's default delay when @ is omitted is 60 s.
    return JobSignal(sig, int(m["delay"] or 60), "B" in (m["where"] or ""), source, spec.strip())


def script_options(script: str) -> dict[str, str]:
    """The ``#SBATCH --key=value`` options sbatch reads: those before the first command line."""
    options: dict[str, str] = {}
    for line in script.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break  # sbatch stops reading #SBATCH lines at the first command
        if stripped.startswith("#SBATCH"):
            for word in shlex.split(stripped[len("#SBATCH") :], comments=True):
                key, _, value = word.lstrip("-").partition("=")
                options[key] = value
    return options


def job_signal(fields: Mapping[str, str], environ: Mapping[str, str], script: str | None) -> JobSignal | None:
    """The job's ``--signal``, from the strongest source available (see the module docstring)."""
    submit_line = fields.get("SubmitLine", "")
    if submit_line:
        words = shlex.split(submit_line)
        for i, word in enumerate(words):
            if word.startswith("--signal="):
                return parse_signal_spec(word.partition("=")[2], "the sbatch command line")
            if word == "--signal" and i + 1 < len(words):
                return parse_signal_spec(words[i + 1], "the sbatch command line")
    if environ.get("SBATCH_SIGNAL"):
        return parse_signal_spec(environ["SBATCH_SIGNAL"], "SBATCH_SIGNAL in the environment")
    if script is not None:
        spec = script_options(script).get("signal")
        if spec:
            return parse_signal_spec(spec, "the script's #SBATCH line")
    return None


def _mb(size: str) -> int | None:
    """``64G`` -> 65536, ``100M`` / ``100`` -> 100 (Slurm's unit is MB)."""
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", size.strip(), re.I)
    if not m:
        return None
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m[2].upper()]
    return int(int(m[1]) * scale)


def _per_node(text: str) -> int | None:
    """``SLURM_TASKS_PER_NODE`` / ``SLURM_JOB_CPUS_PER_NODE`` like ``4(x2)``: the count when uniform."""
    counts = {part.split("(")[0] for part in text.split(",") if part}
    return int(counts.pop()) if len(counts) == 1 and next(iter(counts)).isdigit() else None


def allocation_values(fields: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, object]:
    """What the job actually has, under the ``slurm.*`` names; keys that cannot be told are left out."""
    have: dict[str, object] = {}
    nodes = environ.get("SLURM_JOB_NUM_NODES") or fields.get("NumNodes", "")
    if nodes.isdigit():
        have["nodes"] = int(nodes)
    tasks = environ.get("SLURM_NTASKS_PER_NODE") or _per_node(environ.get("SLURM_TASKS_PER_NODE", ""))
    if tasks:
        have["tasks_per_node"] = int(tasks)
    gpus = environ.get("SLURM_GPUS_PER_NODE") or (re.search(r"gpu:(\d+)$", fields.get("TresPerNode", "")) or [0, ""])[1]
    if str(gpus).isdigit():
        have["gpus_per_node"] = int(gpus)
    elif "SLURM_JOB_ID" in environ and "TresPerNode" not in fields and "SLURM_GPUS_PER_NODE" not in environ:
        have["gpus_per_node"] = 0
    cpus = environ.get("SLURM_CPUS_PER_TASK") or fields.get("CPUs/Task", "")
    if cpus.isdigit():
        have["cpus_per_task"] = int(cpus)
    for key, env, field in (
        ("partition", "SLURM_JOB_PARTITION", "Partition"),
        ("account", "SLURM_JOB_ACCOUNT", "Account"),
        ("qos", "SLURM_JOB_QOS", "QOS"),
        ("constraint", None, "Features"),
    ):
        value = (environ.get(env, "") if env else "") or fields.get(field, "")
        if value:
            have[key] = value
    if fields.get("TimeLimit"):
        try:
            have["time"] = slurm_time.minutes(fields["TimeLimit"])
        except ValueError:
            pass
    mem = environ.get("SLURM_MEM_PER_NODE") or fields.get("MinMemoryNode", "")
    if mem and _mb(mem):
        have["mem"] = _mb(mem)
    if environ.get("SLURM_MEM_PER_GPU"):
        have["mem_per_gpu"] = _mb(environ["SLURM_MEM_PER_GPU"])
    if fields.get("OverSubscribe"):
        have["exclusive"] = fields["OverSubscribe"] == "NO"
    return have


def _differs(key: str, wanted: object, have: object) -> bool:
    if key == "time":
        return slurm_time.minutes(str(wanted)) != have
    if key in ("mem", "mem_per_gpu"):
        return _mb(str(wanted)) != have
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
    try:
        res = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def check_current(cfg: Config, environ: Mapping[str, str]) -> list[str]:
    """:func:`check_allocation` for the job this process runs in (asks ``scontrol``; one call per job is
    enough: call it on rank 0 only). Without Slurm or ``scontrol``, what the environment tells."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return []
    job_text = _scontrol("show", "job", "-o", job_id) or ""
    script = _scontrol("write", "batch_script", job_id, "-") if environ.get("SLURM_JOB_ID") else None
    return check_allocation(cfg, environ, job_text, script)
