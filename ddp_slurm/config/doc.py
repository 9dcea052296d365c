"""The resolved config as YAML, optionally explained: each key with the docstring its dataclass field carries.

``python -m ddp_slurm.train --print-config [--explain]`` prints it; this is the config reference (the
docstrings in ``ddp_slurm/config/sections.py``, ``placement.py`` and ``schema.py`` are its only source, so it
cannot drift from the code).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

from ddp_slurm.config.schema import Config


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass whose fields are each followed by a string literal."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.replace("``", "`").split())
    return docs


def scalar(value: Any) -> str:
    """A value as YAML writes it: ``true``, ``null``, ``'01:00:00'``, ``0.004``."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[: -len("\n...")] if text.endswith("\n...") else text.removesuffix("...").strip()


def render(cfg: Config, explain: bool = False) -> str:
    """The config as YAML that ``--config`` reads back; with ``explain``, every key under a comment
    saying what it means (wrapped at 100 columns). The task's own sections come after the runtime's,
    documented the same way (their docstrings live in the task's code); a config whose task is not
    imported shows them as given."""
    lines: list[str] = []
    if explain:
        lines += [f"# {chunk}" for chunk in textwrap.wrap(field_docs(Config).get("task", ""), 98)]
    lines.append(f"task: {scalar(cfg.task)}")
    for name, section in cfg.sections().items():
        docs = field_docs(type(section)) if explain else {}
        if explain:
            lines.append("")
        lines.append(f"{name}:")
        for f in dataclasses.fields(section):
            if explain and docs.get(f.name):
                for chunk in textwrap.wrap(docs[f.name], 96):
                    lines.append(f"  # {chunk}")
            lines.append(f"  {f.metadata.get('key', f.name)}: {scalar(getattr(section, f.name))}")  # YAML's key
    if not cfg.resolved:  # the task not imported: its keys as given, with no docstring to show
        for name, body in cfg.task_config.sections().items():
            lines += ["", f"# {name}: as given; checked once {cfg.task} is imported"] if explain else []
            lines.append(f"{name}:")
            lines += [f"  {key}: {scalar(value)}" for key, value in body.items()]
    return "\n".join(lines) + "\n"
