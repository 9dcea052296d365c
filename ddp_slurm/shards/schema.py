"""What a shard index may hold, checked before use: a forger can seal anything with the project's own
functions, so the seal says the file is whole, not that its values make sense. A shard entry must name a
plain ``.tar`` in the index's folder and give its size, mtime, ends, count and table digest; a table's
samples must lie inside their shard, and each member inside its sample (no read past a shard, no huge
allocation from a forged range)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddp_slurm.shards.errors import ShardError


@dataclass
class Table:
    """One shard's samples, as the index recorded them."""

    keys: list[str]
    start: list[int]
    end: list[int]
    hash: list[str]
    members: list[list[list]]


_ENTRY = {"name": str, "size": int, "mtime_ns": int, "ends": str, "samples": int, "table": str}


def _forged(file: Path, what: str) -> ShardError:
    return ShardError(
        f"{file} is damaged or not written by ddp-slurm ({what}): run `ddp-slurm data index {file.parent.parent}` again"
    )


def checked_entries(shards: object, file: Path) -> list[dict]:
    if not isinstance(shards, list):
        raise _forged(file, "no list of shards")
    for entry in shards:
        if not isinstance(entry, dict) or any(type(entry.get(k)) is not t for k, t in _ENTRY.items()):
            raise _forged(file, f"a shard entry without {', '.join(_ENTRY)}")
        name = entry["name"]
        if "/" in name or name.startswith(".") or not name.endswith(".tar"):
            raise _forged(file, f"shard name {name!r}")
        digests = len(entry["ends"]) == 16 and len(entry["table"]) == 32
        if min(entry["size"], entry["samples"]) < 0 or not digests or not _hex(entry["ends"] + entry["table"]):
            raise _forged(file, f"shard {name}'s size, count or table")
    return shards


def checked_table(t: object, size: int, file: Path) -> Table:
    """A shard's table, each sample's byte range inside the shard and each member's inside its sample."""
    columns = ("keys", "start", "end", "hash", "members")
    if not isinstance(t, dict) or not all(isinstance(t.get(c), list) for c in columns):
        raise _forged(file, "a table without keys, ranges, hashes and members")
    n = len(t["keys"])
    if any(len(t[c]) != n for c in columns):
        raise _forged(file, "columns of different lengths")
    for key, start, end, digest, members in zip(*(t[c] for c in columns)):
        if not (isinstance(key, str) and isinstance(digest, str) and _int(start) and _int(end)):
            raise _forged(file, "a sample's key, range or hash")
        if not 0 <= start <= end <= size or not isinstance(members, list):
            raise _forged(file, f"sample {key!r}'s range {start}-{end} in a shard of {size} bytes")
        for m in members:
            ok = isinstance(m, list) and len(m) == 3 and isinstance(m[0], str) and _int(m[1]) and _int(m[2])
            if not ok or m[1] < 0 or m[2] < 0 or m[1] + m[2] > end - start:
                raise _forged(file, f"sample {key!r}'s members")
    return Table(t["keys"], t["start"], t["end"], t["hash"], t["members"])


def _int(v: object) -> bool:
    return type(v) is int


def _hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)
