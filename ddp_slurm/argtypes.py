"""Checked command-line values: the argparse types of every number, list and path a tool's flags take.

argparse's ``type=int`` takes 10**30 and its ``type=float`` takes nan, inf and 1e400 (inf): such a
value then reaches a timer, an allocation or a loop far from the flag, as a traceback, a run that never
ends or a machine out of memory. These types refuse it while the command line is parsed, before
anything starts, and argparse names the flag ("argument --timeout: expected a number > 0 and <= ...,
got 'nan'"); ``OneLineParser`` keeps argparse's errors to that one line (exit 2), without the usage
block. Upper bounds that depend on the machine (CPUs, memory) say where they come from.

Torch-free: the launchers, the doctor and the bench import it before anything else.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from ddp_slurm import hostmem, safefs
from ddp_slurm.exitcodes import EXIT_USAGE
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.text import CONTROL, shown

MAX_TIMEOUT_S = 1e7  # as dist.timeout_s: beyond it, timers and timedeltas overflow
MAX_LIST = 1000  # values in one comma-separated list flag
MEMORY_SHARE = 0.5  # of the host's available memory that one tool may plan to hold


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors as one line on stderr (exit 2): no usage block above it, and control
    characters of what was typed shown escaped, so a newline in a value cannot split the line."""

    def error(self, message: str) -> NoReturn:
        message = shown(message)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _limit(high: float, why: str) -> str:
    return _show(high) + (f" ({why})" if why else "")


def integer(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An integer ``low <= n <= high`` (no upper bound: None); ``why`` says where ``high`` comes from."""
    expected = f"an integer >= {low}" if high is None else f"an integer from {low} to {_limit(high, why)}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def number(low: float, high: float, why: str = "", above: bool = False) -> Callable[[str], float]:
    """A finite number ``low <= x <= high`` (``above``: ``low < x``); nan, inf and 1e400 never pass."""
    expected = f"a number {'>' if above else '>='} {_show(low)} and <= {_limit(high, why)}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def integers(low: int, high: int, why: str = "", unique: bool = False) -> Callable[[str], list[int]]:
    """A comma-separated list of integers, each ``low <= n <= high``, at most ``MAX_LIST`` of them."""
    one = integer(low, high, why)

    def parse(text: str) -> list[int]:
        parts = text.split(",")
        if len(parts) > MAX_LIST:
            raise argparse.ArgumentTypeError(f"expected at most {MAX_LIST} comma-separated values, got {len(parts)}")
        try:
            values = [one(part) for part in parts]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}, e.g. {low},{low + 1}") from None
        if unique and len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
        return values

    return parse


def memory_mib(share: float = MEMORY_SHARE) -> tuple[float, str]:
    """(``share`` of the host's available memory in MiB, where that bound comes from) for a flag's
    upper bound; 1 TiB where the OS does not say."""
    avail = hostmem.available_memory()
    if avail is None:
        return float(1 << 20), "1 TiB"
    return math.floor(share * avail / 2**20), f"{share:.0%} of this host's available memory, in MiB"


def plain_text(text: str) -> str:
    """``text`` unchanged unless it holds control characters (a path or name that would split a line)."""
    if CONTROL.search(text):
        raise argparse.ArgumentTypeError(f"expected text without control characters, got {text!r}")
    return text


def _probe(folder: Path, shown: str) -> None:
    """Create and remove a new file in ``folder``: the one sure test that a later write there can succeed."""
    try:
        tmp = safefs.temp_name(folder / ".probe")
        os.close(safefs.open_new(tmp))
        tmp.unlink()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {shown}: {exc.strerror or exc}") from None


def output_file(text: str) -> Path:
    """A file to (re)write: its folder exists and takes new files; the path, if there, is a plain file
    (or a symlink, which ``safefs.write_atomic`` replaces without following)."""
    path = Path(plain_text(text))
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror or exc}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: name a file in it")
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise argparse.ArgumentTypeError(f"{text!r} is a FIFO, device or socket, not a plain file")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the folder {str(folder)!r} does not exist")
    _probe(folder, repr(text))
    return path


def output_dir(text: str) -> Path:
    """An existing folder that takes new files."""
    path = Path(plain_text(text))
    if not path.is_dir():
        what = "does not exist" if not os.path.lexists(path) else "is not a directory"
        raise argparse.ArgumentTypeError(f"{text!r} {what}: name an existing folder")
    _probe(path, repr(text))
    return path


def run_dir(text: str) -> Path:
    """An existing run directory (one that holds ``config.yaml``) that takes new files: a mistyped name is
    refused, never created."""
    path = output_dir(text)
    if not RunPaths(path).config.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a run directory (no config.yaml in it): name runs/<name>")
    return path


def input_file(text: str) -> Path:
    """A path to read (whoever reads it checks what is there); no control characters in it."""
    return Path(plain_text(text))
