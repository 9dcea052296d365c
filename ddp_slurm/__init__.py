"""ddp_slurm: PyTorch DistributedDataParallel training on Slurm that survives preemption and resumes exactly.

Your own model: subclass ``ddp_slurm.Task`` (docs/tasks.md) and train it with
``python -m ddp_slurm.train task=my_project.tasks:Digits`` or ``ddp_slurm.run(Digits, overrides)``.

Layout (docs/architecture.md): launch (submit, the local launcher) and bench on top; tools (doctor, report);
train (the runtime: task interface, loop, strategy, checkpoints, hooks, signals) and tasks (mnist);
distributed (which rank am I, the process group, the watchdog) and slurmjob (the Slurm job around it);
config; and the torch-free base (errors, exit codes, run directory paths, safe files).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "Task": "ddp_slurm.train.task",
    "Tensors": "ddp_slurm.train.task",
    "Shards": "ddp_slurm.shards.dataset",
    "Context": "ddp_slurm.train.task",
    "Hook": "ddp_slurm.train.hooks.base",
    "Stateful": "ddp_slurm.train.checkpoint.parts",
    "run": "ddp_slurm.train.entry",
    "load_model": "ddp_slurm.tools.export",
    "checked": "ddp_slurm.config",
    "ConfigError": "ddp_slurm.config",
    "Error": "ddp_slurm.errors",
    "exit_now": "ddp_slurm.exitcodes",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    """The public API, imported on first use: ``import ddp_slurm`` stays free of torch."""
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ddp_slurm' has no attribute {name!r}")
