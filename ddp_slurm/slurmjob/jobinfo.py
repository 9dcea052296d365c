"""What a Slurm job is, read from ``scontrol show job``, the ``SLURM_*`` variables and its batch script.

Pure functions of the texts they are given (``scontrol`` itself is run by :mod:`ddp_slurm.slurmjob.allocation`):
the job's fields, its ``--signal`` and the resources it holds under the config's ``slurm.*`` names.
"""

from __future__ import annotations

import re
import shlex
import signal as _signal
from collections.abc import Mapping
from dataclasses import dataclass

from ddp_slurm import slurm_time
from ddp_slurm.config import ConfigError

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


def mb(size: str) -> int | None:
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
    if mem and mb(mem):
        have["mem"] = mb(mem)
    if environ.get("SLURM_MEM_PER_GPU"):
        have["mem_per_gpu"] = mb(environ["SLURM_MEM_PER_GPU"])
    if fields.get("OverSubscribe"):
        have["exclusive"] = fields["OverSubscribe"] == "NO"
    return have
