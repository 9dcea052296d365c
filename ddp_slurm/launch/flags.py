"""``submit``'s resource flags, read from the fields of the config's ``slurm`` section.

Why: each ``slurm.*`` key is declared once, on its field (``config/placement.py``: type, default, docstring,
value check). The flags are made from those fields the way submitit reads its parameters from a
signature: ``gpus_per_node`` is ``--gpus-per-node``, the help is the field's docstring, and a value is
read and checked by the rule the config uses for the same key (``config.value_of``), so a flag and a
``slurm.gpus_per_node=`` override cannot disagree. A field declares other spellings (``-N``,
``--ntasks-per-node``, ``--signal-delay``), or none, with ``checked(..., flags=...)``. A flag given
becomes a ``slurm.*`` override, so the run directory's config.yaml records what was asked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any, Literal

from ddp_slurm import config
from ddp_slurm.config import SlurmConfig
from ddp_slurm.config.doc import field_docs


@dataclass(frozen=True)
class Flag:
    """One resource flag: the config key it sets, how it is spelled, its argparse attribute."""

    key: str  # "slurm.gpus_per_node"
    spellings: tuple[str, ...]  # ("--gpus-per-node",)
    dest: str  # the field's name
    kind: Any  # the field's type
    help: str


def _flags() -> tuple[Flag, ...]:
    docs = field_docs(SlurmConfig)
    hints = typing.get_type_hints(SlurmConfig)
    found = []
    for f in dataclasses.fields(SlurmConfig):
        key = f.metadata.get("key", f.name)
        spellings = f.metadata.get("flags", ("--" + key.replace("_", "-"),))
        if spellings:
            text = docs.get(f.name, "").replace("`", "").replace("%", "%%")
            found.append(Flag(f"slurm.{key}", spellings, f.name, hints[f.name], f"{text} (slurm.{key})"))
    return tuple(found)


FLAGS = _flags()

# sbatch options that submit sets itself: --sbatch may not say them a second time (sbatch name -> what to use).
OWN_OPTIONS = {s[2:].replace("-", "_"): s for flag in FLAGS for s in flag.spellings if s.startswith("--")} | {
    "signal": "--signal and --signal-delay (slurm.signal, slurm.signal_delay_s)",
    "requeue": "slurm.requeue",
    "no_requeue": "slurm.requeue",
    "job_name": "--name",
    "output": "the run directory's submitit/ folder",
    "error": "the run directory's submitit/ folder",
    "array": "--sweep",
}


def _reader(key: str):
    """argparse's ``type=``: the text as ``key`` takes it, or the config's own "expected ..." as the error."""

    def read(text: str) -> Any:
        try:
            return config.value_of(key, text)
        except config.ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return read


def _metavar(flag: Flag) -> str:
    choices = typing.get_args(flag.kind) if typing.get_origin(flag.kind) is Literal else ()
    if choices:
        return "{" + ",".join(choices) + "}"
    return "N" if int in (flag.kind, *typing.get_args(flag.kind)) else flag.dest.upper()


def add_to(group: argparse._ArgumentGroup) -> None:
    """The resource flags, none set by default (the config's ``slurm`` section is the default)."""
    for flag in FLAGS:
        if flag.kind is bool:  # --exclusive: asks for it; the config's false is the default
            group.add_argument(*flag.spellings, dest=flag.dest, action="store_const", const=True, help=flag.help)
        else:
            group.add_argument(
                *flag.spellings, dest=flag.dest, type=_reader(flag.key), metavar=_metavar(flag), help=flag.help
            )


def overrides(args: argparse.Namespace) -> list[str]:
    """The flags given, as ``slurm.*`` overrides (a JSON value is a YAML scalar: text stays text)."""
    return [f"{f.key}={json.dumps(getattr(args, f.dest))}" for f in FLAGS if getattr(args, f.dest, None) is not None]
