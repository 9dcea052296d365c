"""``bench forecast --from A.json[,B.json]``: the measurements of earlier runs, read back.

A saved file is read as any file a co-tenant could have put there: never through a symlink or from a
FIFO, never more than a small file's bytes (``safefs.read_small``), and every value the forecast uses
checked for its type and range, so a damaged or forged file is one line (exit 2), not a traceback
or a forecast from nan.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from ddp_slurm import argtypes, safefs
from ddp_slurm.bench import common


def sources(text: str) -> list[str]:
    names = [argtypes.plain_text(name) for name in text.split(",")]
    if len(names) > argtypes.MAX_LIST or not all(names):
        raise argparse.ArgumentTypeError(f"expected JSON files of this command, comma-separated, got {text!r}")
    return names


# What --from needs of a saved run's "measured" part: key -> (types, check).
_COUNT, _NUMBER = (lambda v: v >= 1), (lambda v: math.isfinite(v) and v >= 0)
SAVED = {
    "world_size": (int, _COUNT),
    "nodes": (int, _COUNT),
    "ranks_per_node": (int, _COUNT),
    "batch_per_rank": (int, _COUNT),
    "grad_bytes": (int, _COUNT),
    "compute_s": ((int, float), _NUMBER),
    "forward_s": ((int, float), _NUMBER),
    "model": (str, str.isprintable),
    "backend": (str, str.isprintable),
    "device": (str, str.isprintable),
}
SAVED_FIT = {"alpha_s": ((int, float), _NUMBER), "beta_s_per_byte": ((int, float), _NUMBER)}


def read(name: str) -> dict[str, Any]:
    """The "measured" part of a forecast JSON this command wrote, every value it is used for checked:
    BenchError naming the file otherwise (a FIFO, a huge file or a forged one included)."""
    try:
        text = safefs.read_small(Path(name))
        m = json.loads(text)["measured"] if text is not None else None
    except (OSError, safefs.UnsafePath, ValueError, KeyError, TypeError) as exc:
        raise common.BenchError(f"--from {name}: cannot read a forecast JSON ({exc})") from None
    if m is None:
        raise common.BenchError(f"--from {name}: no such file")
    if not isinstance(m, dict):
        raise common.BenchError(f"--from {name}: not a forecast JSON ('measured' is not a mapping)")
    fitted = m.get("world_size") != 1 or SAVED_FIT.keys() & m.keys()  # the fit is used wherever it is
    for key, (types, check) in {**SAVED, **(SAVED_FIT if fitted else {})}.items():
        value = m.get(key)
        if not isinstance(value, types) or isinstance(value, bool) or not check(value):
            raise common.BenchError(f"--from {name}: measured.{key} is missing or not a valid value ({value!r:.60})")
    buckets = m.get("buckets")
    if not isinstance(buckets, list) or not buckets or not all(type(b) is int and b >= 0 for b in buckets):
        raise common.BenchError(f"--from {name}: measured.buckets is not a list of byte counts")
    step = m.get("measured_step_s")
    if step is not None and (type(step) not in (int, float) or not math.isfinite(step) or step <= 0):
        raise common.BenchError(f"--from {name}: measured.measured_step_s is not a positive number")
    return m
