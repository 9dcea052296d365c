"""The commands the README and docs/ show, read from their code blocks (one home for the parsing).

A ```bash block is run here, in order, by tests/test_docs.py; a ```sh block needs what this machine's
plain test run has not got (make's own install, internet, a Slurm cluster) and each of its commands is
claimed by the test that runs it (``ELSEWHERE`` in tests/test_docs.py). A line ending in ``\\`` goes on
on the next one; after two spaces, ``#`` starts the comment: ``exit N`` there is the exit status the
command must have (0 otherwise) and a quoted "text" must appear in its output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Command:
    text: str
    """The command, continuation lines joined."""
    page: str
    """Where it is shown, relative to the repository root."""
    lang: str
    """The block's language: ``bash`` (run here) or ``sh`` (run elsewhere)."""
    code: int = 0
    """The exit status the comment states (``exit N``), 0 otherwise."""
    quoted: tuple[str, ...] = field(default=())
    """Texts the comment quotes, which the output must contain."""


def commands(page: Path) -> list[Command]:
    """Every command of ``page``'s ```bash and ```sh blocks, in order."""
    found = []
    name = str(page.relative_to(REPO))
    for lang, block in re.findall(r"^```(bash|sh)\n(.*?)^```", page.read_text(), re.M | re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            command, _, comment = line.partition("  #")
            if not command.strip():
                continue
            code = re.search(r"\bexit (\d+)", comment)
            quoted = tuple(re.findall(r'"([^"]+)"', comment))
            found.append(Command(command.strip(), name, lang, int(code[1]) if code else 0, quoted))
    return found


def files(page: Path) -> dict[str, str]:
    """The files a page asks the reader to write: a ```python block right after a line naming it
    (`` `line.py`, anywhere: ``), by name."""
    named = r"^`([\w./-]+\.py)`[^\n]*:\n\n```python\n(.*?)^```"
    return dict(re.findall(named, page.read_text(), re.M | re.S))
