"""A config's task sections as given, while its task is not imported: read, kept, never checked.

Why: a task's sections are checked against its ``Config`` dataclass, which lives in the task's Python
file, and importing that file runs it. A command that only reads a run (``report``, ``submit
--dry-run``, ``resume``'s checks, a checkpoint's embedded config compared with the live one) reads a
``config.yaml`` that names a task file, and a co-tenant could have written both. So reading keeps the
task's keys here, as the file or command line gave them, and only ``config.resolve`` (training, a real
``submit``) imports the task and checks them; ``relaunch.changes_from`` checks a saved config's task
sections with the live config's own, already imported task class.

Values are YAML scalars (a task's keys are scalars; a list or mapping could only be an error, or an
alias bomb kept for later) and strings hold no control characters, as for every other key.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Given:
    """One task key's value as given: where (a file, ``the command line``) and, for an override, the text typed
    (``model.name=3`` means the text ``"3"`` when the key turns out to be a string)."""

    value: Any
    where: str
    text: str | None = None


@dataclass
class Unchecked:
    """The task's sections of a config whose task is not imported: ``"section.key" -> Given``, in order."""

    task_where: str = "the defaults"  # where ``task`` was given, for the import's error message
    values: dict[str, Given] = field(default_factory=dict)

    def sections(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}`` as YAML holds them."""
        out: dict[str, dict[str, Any]] = {}
        for key, given in self.values.items():
            section, _, name = key.partition(".")
            out.setdefault(section, {})[name] = given.value
        return out

    def section(self, name: str) -> types.SimpleNamespace | None:
        """One section read like a checked one (``cfg.data.root``); None when nothing gave it."""
        body = self.sections().get(name)
        return None if body is None else types.SimpleNamespace(**body)
