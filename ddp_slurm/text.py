"""Plain-text tables: one renderer for the doctor, sweep summaries and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence


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
