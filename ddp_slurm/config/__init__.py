"""Typed run configuration: dataclasses, YAML files and dotted ``KEY=VALUE`` overrides.

- ``schema.py``: every section as a dataclass; each key declared once, on its field (type, default,
  docstring, and through ``checked`` its value check, resumability and YAML key);
- ``loading.py``: defaults, then a file, then overrides, each value checked (``load``), and the
  resolved config written into a run directory and read back (``dump``, ``read_resolved``);
- ``resume.py``: which keys a relaunch of the same run may change (``incompatible_changes``);
- ``doc.py``: the printed reference (``--print-config --explain``), from the fields' docstrings.

Everything is importable from here (``ddp_slurm.config.load``, ``ddp_slurm.config.Config``, ...).
Torch-free: ``--help`` and ``--print-config`` answer without it.
"""

from ddp_slurm.config.loading import (
    CONTROL,
    MAX_CONFIG_BYTES,
    check_world_size,
    dump,
    from_dict,
    load,
    parse_override,
    parse_yaml_file,
    read_resolved,
    read_text,
)
from ddp_slurm.config.resume import incompatible_changes
from ddp_slurm.config.schema import (
    RUN_NAME,
    RUNTIME_SECTIONS,
    SLURM_WORD,
    CheckpointConfig,
    Config,
    ConfigError,
    DistConfig,
    LogConfig,
    RunConfig,
    SlurmConfig,
    TrainConfig,
    checked,
    task_class,
)

__all__ = [
    "CONTROL",
    "MAX_CONFIG_BYTES",
    "RUN_NAME",
    "RUNTIME_SECTIONS",
    "SLURM_WORD",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DistConfig",
    "LogConfig",
    "RunConfig",
    "SlurmConfig",
    "TrainConfig",
    "check_world_size",
    "checked",
    "dump",
    "from_dict",
    "incompatible_changes",
    "load",
    "parse_override",
    "parse_yaml_file",
    "read_resolved",
    "read_text",
    "task_class",
]


def changes_from(saved, cfg, where):  # TEMPORARY shim until the config layer reads without importing
    return incompatible_changes(from_dict(saved, where), cfg)


def read_saved(path):  # TEMPORARY shim
    import yaml

    return yaml.safe_load(read_text(path))
