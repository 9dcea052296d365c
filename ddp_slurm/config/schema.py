"""The config's schema: every section as a dataclass, and each key declared once, on its field.

The runtime's sections live in ``sections.py`` (``run``, ``train``, ``eval``, ``checkpoint``, ``guard``, and
``checked``, the declaration of a field: its value check, whether it may change between the launches of one
run, its YAML key and ``submit`` flags) and ``placement.py`` (``dist``, ``slurm``, ``log``); here they become
one ``Config``, beside the task's own sections. Other modules of the package read these declarations:
``loading`` (files, overrides, checks), ``relaunch`` (what a relaunch may change), ``launch/flags.py``
(``submit``'s resource flags).

A config's task sections are checked only once its task is imported (``Config.resolved``): reading a
run (``report``, a dry run, resume's checks, a checkpoint's embedded config) keeps them as given
(``Unchecked``), because importing runs the Python file the config names, which a co-tenant may have
written together with the config.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_slurm import errors, taskref
from ddp_slurm.config.placement import DistConfig, LogConfig, SlurmConfig
from ddp_slurm.config.sections import CheckpointConfig, EvalConfig, GuardConfig, RunConfig, TrainConfig
from ddp_slurm.config.unchecked import Unchecked
from ddp_slurm.runpaths import RunPaths


class ConfigError(errors.UsageError, ValueError):
    """A config file, override or value that cannot be used (exit 2). The message is one line."""


RUNTIME_SECTIONS = ("run", "train", "eval", "checkpoint", "guard", "dist", "slurm", "log")
"""Sections every task shares; a task's own sections are the fields of its ``Config`` dataclass."""


@dataclass(eq=False)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    log: LogConfig = field(default_factory=LogConfig)
    task: str = taskref.DEFAULT
    """Which task trains: ``package.module:Name`` or ``path/to/file.py:Name`` (unset: built-in MNIST)."""
    task_config: Any = None
    """The task's own sections: an instance of its ``Config`` (the task imported), or ``Unchecked`` (the
    sections as given, the task not imported: a config read from a run); None: the task's defaults."""

    def __post_init__(self) -> None:
        if self.task_config is None:  # asked for by the caller, in Python: the task's defaults need the task
            self.task_config = task_class(self.task).Config()
        if not isinstance(self.task_config, Unchecked):
            # A task file by its absolute path from here on (imported, above, as typed: messages show it so):
            # the run directory's config.yaml then names it for a resume from anywhere. A config read back
            # (Unchecked) keeps what it says; relaunch compares both sides made absolute.
            self.task = taskref.absolute(self.task)

    @property
    def resolved(self) -> bool:
        """Whether the task was imported and its sections checked (``config.resolve``)."""
        return not isinstance(self.task_config, Unchecked)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the task's sections read like the runtime's (cfg.data.root).
        task_config = self.__dict__.get("task_config")
        if isinstance(task_config, Unchecked):
            found = task_config.section(name)
            if found is not None:
                return found
        elif task_config is not None and name in _keys(task_config):
            return getattr(task_config, name)
        raise AttributeError(f"config has no section {name!r}")

    def __eq__(self, other: object) -> bool:
        """The same keys and values (a config read back from its YAML equals the one written)."""
        return self.to_dict() == other.to_dict() if isinstance(other, Config) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  (mutable, compared by value)

    @property
    def run_dir(self) -> Path:
        if self.run.name is None:
            raise ValueError("run.name is not chosen yet (ddp_slurm.train.runname names new runs)")
        return Path(self.run.output_root) / self.run.name

    @property
    def paths(self) -> RunPaths:
        """The run directory's files, and ``run.shared`` for whoever writes them."""
        return RunPaths(self.run_dir, self.run.shared)

    def with_run(self, **changes: Any) -> Config:
        """A copy whose ``run`` section has ``changes`` (``with_run(name="r1")``), this config untouched: what a
        launch chooses for itself (a new run's name, the checkpoint a warm start located) goes into its own
        copy. Every section is copied, the task's too; the values are taken as given (chosen by the runtime,
        not typed by a user: no check)."""
        out = copy.deepcopy(self)
        out.run = dataclasses.replace(out.run, **changes)
        return out

    def sections(self) -> dict[str, Any]:
        """Every checked section by name: the runtime's, then the task's (none while it is ``Unchecked``)."""
        own = {name: getattr(self, name) for name in RUNTIME_SECTIONS}
        if not self.resolved:
            return own
        return own | {name: getattr(self.task_config, name) for name in _keys(self.task_config)}

    def to_dict(self) -> dict[str, Any]:
        """``task`` and sections of ``{key: value}``, keyed as in YAML (``checkpoint.async``, not ``async_save``);
        an unresolved config's task sections as given."""
        out = {"task": self.task} | {
            name: {_key(f): getattr(sec, f.name) for f in dataclasses.fields(sec)}
            for name, sec in self.sections().items()
        }
        return out if self.resolved else out | self.task_config.sections()


def _keys(obj: Any) -> dict[str, str]:
    """``{key: field name}`` of a section."""
    return {_key(f): f.name for f in dataclasses.fields(obj)}


def task_class(spec: str) -> type:
    """The Task class named by ``spec``; ConfigError (exit 2) when it cannot be used."""
    try:
        cls = taskref.resolve(spec)
    except taskref.TaskError as exc:
        raise ConfigError(str(exc)) from None
    clash = set(_keys(cls.Config)) & {*RUNTIME_SECTIONS, "task", "log"}
    if clash:
        raise ConfigError(
            f"task={spec!r}: its Config reuses the runtime's section name(s) {sorted(clash)}: rename them"
        )
    return cls


def _key(f: dataclasses.Field) -> str:
    """A field's key in YAML and on the command line: its name, or ``metadata["key"]`` where the
    key is a Python keyword (``checkpoint.async`` is the field ``async_save``)."""
    return f.metadata.get("key", f.name)


def _field_types(obj: Any) -> Mapping[str, Any]:
    return _type_hints(type(obj))


@functools.cache
def _type_hints(cls: type) -> Mapping[str, Any]:
    """A section's field types, evaluated once per class: ``typing.get_type_hints`` compiles every
    annotation string again on each call, and a config is read per key (pruning compares the config
    of each kept checkpoint with the run's at every save: 30 ms of a 50 ms save was this)."""
    return types.MappingProxyType(typing.get_type_hints(cls))


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}
