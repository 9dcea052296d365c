"""Typed run configuration: dataclasses, YAML files and dotted ``KEY=VALUE`` overrides.

- ``schema.py``: the whole ``Config``, the runtime's sections and the task's; each key declared once, on
  its field (type, default, docstring, and through ``checked`` its value check, resumability, YAML key and
  ``submit`` flags), the runtime's sections in ``sections.py`` (``run``, ``train``, ``eval``, ``checkpoint``,
  ``guard``) and ``placement.py`` (``dist``, ``slurm``, ``log``);
- ``files.py``: a config file read safely and written atomically; a run's ``config.yaml`` read back as the
  mapping it holds (``read_saved``, ``dump``);
- ``loading.py``: defaults, then a file, then overrides, each value checked (``load``); the task imported
  only when asked for (``resolve``), never for a config read from a run (``read_resolved``);
- ``unchecked.py``: a task's sections as given while its task is not imported;
- ``relaunch.py``: which keys a relaunch of the same run may change (``changes_from``, ``incompatible_changes``);
- ``doc.py``: the printed reference (``--print-config --explain``), from the fields' docstrings.

Everything is importable from here (``ddp_slurm.config.load``, ``ddp_slurm.config.Config``, ...).
Torch-free: ``--help`` and ``--print-config`` answer without it.
"""

from ddp_slurm.config.files import (
    MAX_CONFIG_BYTES,
    damaged,
    dump,
    parse_override,
    parse_yaml_file,
    read_saved,
    read_text,
)
from ddp_slurm.config.loading import (
    CONTROL,
    accumulation,
    check_node_range,
    check_world_size,
    checked_with,
    from_dict,
    load,
    read_resolved,
    resolve,
    value_of,
    with_overrides,
)
from ddp_slurm.config.placement import SLURM_WORD, DistConfig, LogConfig, SlurmConfig
from ddp_slurm.config.relaunch import changed_config, changes_from, incompatible_changes
from ddp_slurm.config.schema import RUNTIME_SECTIONS, Config, ConfigError, task_class
from ddp_slurm.config.sections import RUN_NAME, CheckpointConfig, EvalConfig, RunConfig, TrainConfig, checked

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
    "EvalConfig",
    "LogConfig",
    "RunConfig",
    "SlurmConfig",
    "TrainConfig",
    "changed_config",
    "changes_from",
    "accumulation",
    "check_node_range",
    "check_world_size",
    "checked",
    "checked_with",
    "damaged",
    "dump",
    "from_dict",
    "incompatible_changes",
    "load",
    "parse_override",
    "parse_yaml_file",
    "read_resolved",
    "read_saved",
    "read_text",
    "resolve",
    "task_class",
    "value_of",
    "with_overrides",
]
