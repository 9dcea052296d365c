"""Plain text for terminals: tables (one renderer for the doctor, sweep summaries and the benchmarks) and
docstrings shown as ``--help`` text."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

# Control characters (C0, DEL, C1): they split a line, move the cursor or recolour a terminal.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """``text`` safe to print: each control character as its escape (``\\n``, ``\\x1b``), so what a file
    holds can neither forge a line of ours nor drive the terminal."""
    return CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


# reST in docstrings: ``literal``, :role:`target` and :role:`~pkg.mod.Name` (shown as Name).
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def is_percent(name: str, percent: Collection[str] | None = None) -> bool:
    """Whether metric ``name`` is a fraction shown x100 with a % sign: named in ``percent`` (a task's
    ``percent_metrics``), or, where the task declares none (None), a name containing ``accuracy``."""
    return name in percent if percent is not None else "accuracy" in name


def metric_value(name: str, value: float, percent: Collection[str] | None = None) -> str:
    """``97.50%`` for a fraction shown as a percentage (``is_percent``), ``0.0003142`` for the rest."""
    return f"{100 * value:.2f}%" if is_percent(name, percent) else f"{value:.4g}"


def counted(n: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``: a count and its noun, singular for one."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def plain(doc: str | None) -> str:
    """A docstring as a terminal shows it in ``--help``: reST literals and roles unwrapped
    (``python -m x`` -> python -m x, :mod:`ddp_slurm.bench.tta` -> ddp_slurm.bench.tta)."""

    def role(match: re.Match[str]) -> str:
        target = match[1]
        return target.rpartition(".")[2] if match[0].startswith(":") and "`~" in match[0] else target

    return _LITERAL.sub(r"\1", _ROLE.sub(role, doc or ""))


def columns(lines: Sequence[Sequence[str]], numeric_from: int | None = None, rule: bool = False) -> list[str]:
    """Each line's cells padded to their column's width, two spaces apart, trailing space dropped.
    Columns from ``numeric_from`` on are right-aligned (figures), the others left-aligned; ``rule``: a
    line of dashes under the first (the header)."""
    lines = [[str(c) for c in line] for line in lines]
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(max(map(len, lines), default=0))]

    def cell(i: int, text: str) -> str:
        return text.rjust(widths[i]) if numeric_from is not None and i >= numeric_from else text.ljust(widths[i])

    out = ["  ".join(cell(i, c) for i, c in enumerate(line)).rstrip() for line in lines]
    if rule and out:
        out.insert(1, "  ".join("-" * w for w in widths))
    return out
