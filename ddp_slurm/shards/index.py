"""The index of a folder of shards: built once (``ddp-slurm data index DIR``), read by every rank.

Layout, beside the shards: ``DIR/.ddp-slurm-index/index.json`` lists each shard (name, size, mtime, the
hash of its ends, its sample count, the digest of its table) and is sealed like a checkpoint (the XXH3
trailer of ``train/checkpoint/seal.py``); ``tables/<digest>.json`` holds one shard's samples (key, byte
range, hash, members), read only when a process first opens that shard and checked against the digest the
sealed index names. A rebuild writes new tables first and the index last (one atomic rename), so a job
reading the old index keeps its tables until the rebuild prunes them.

Reading goes through the checkpoints' gate: no symlink, a plain file, and nobody but its owner (or the
group, with ``run.shared``) able to write it (``safefs.check_trusted``; a dataset another user publishes
read-only passes). Nothing is unpickled: the index is JSON.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from array import array
from pathlib import Path

import xxhash

from ddp_slurm import safefs
from ddp_slurm.shards import tarscan
from ddp_slurm.shards.errors import ShardError, ShardUsageError
from ddp_slurm.shards.schema import Table, checked_entries, checked_table
from ddp_slurm.train.checkpoint.seal import SLICE, XXH3

log = logging.getLogger(__name__)

FOLDER, INDEX, TABLES = ".ddp-slurm-index", "index.json", "tables"
FORMAT = 1
LIMIT = 1 << 31  # bytes an index file may hold (10^5 shards take about 20 MB)


def command(folder: Path) -> str:
    return f"`ddp-slurm data index {folder}`"


def sealed(body: bytes) -> bytes:
    """``body`` with the checkpoints' seal appended."""
    digests = [XXH3.new(body[i : i + SLICE]).digest() for i in range(0, len(body), SLICE)]
    return body + XXH3.trailer(XXH3.seal_of(digests))


def unsealed(data: bytes, path: Path) -> bytes:
    """The body of a sealed file; ``ShardError`` when the seal is missing or does not match."""
    body, tail = data[: -XXH3.trailer_bytes], data[-XXH3.trailer_bytes :]
    if not tail.startswith(XXH3.magic) or sealed(body) != data:
        raise ShardError(f"{path} is damaged (its seal does not match): run {command(path.parent.parent)} again")
    return body


def shards_in(folder: Path) -> list[Path]:
    """The shards of a folder: its ``*.tar`` files, by name (compressed ones are refused by name too)."""
    if not folder.is_dir():
        raise ShardUsageError(f"{folder} is not a folder of shards")
    for pattern in ("*.tar.gz", "*.tgz", "*.tar.zst", "*.tar.xz", "*.tar.bz2"):
        found = sorted(folder.glob(pattern))
        if found:
            raise ShardError(
                f"{found[0]} is compressed: shards must be plain tars (no random access in a compressed one); "
                f"decompress them, then run {command(folder)}"
            )
    return sorted(p for p in folder.glob("*.tar") if p.is_file())


def build(folder: Path, shared: bool = False) -> dict:
    """Index every shard of ``folder`` (see the module docstring); the index written, its summary returned."""
    folder = Path(folder)
    shards = shards_in(folder)
    if not shards:
        raise ShardUsageError(f"{folder} holds no .tar shards")
    where = folder / FOLDER
    safefs.make_dir(where, shared, parents=False)  # a planted link at either level is refused, never written through
    safefs.make_dir(where / TABLES, shared, parents=False)
    entries, total = [], 0
    for n, shard in enumerate(shards):
        samples = tarscan.scan(shard)
        if not samples:
            raise ShardError(f"{shard} holds no samples (members named <key>.<ext>)")
        body = json.dumps(
            {
                "shard": shard.name,
                "keys": [s.key for s in samples],
                "start": [s.start for s in samples],
                "end": [s.end for s in samples],
                "hash": [s.hash for s in samples],
                "members": [s.members for s in samples],
            },
            separators=(",", ":"),
        ).encode()
        digest = xxhash.xxh3_128_hexdigest(body)
        table = where / TABLES / f"{digest}.json"
        if not table.exists():
            safefs.write_atomic(table, lambda f, b=body: f.write(b), shared)
        st = os.stat(shard)
        with shard.open("rb") as f:
            ends = tarscan.ends_hash(f.fileno(), st.st_size)
        entries.append(
            {
                "name": shard.name,
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "ends": ends,
                "samples": len(samples),
                "table": digest,
            }
        )
        total += len(samples)
        if (n + 1) % 100 == 0:
            log.info("indexed %d of %d shards (%d samples)", n + 1, len(shards), total)
    body = json.dumps({"format": FORMAT, "samples": total, "shards": entries}, indent=0).encode()
    safefs.write_atomic(where / INDEX, lambda f: f.write(sealed(body)), shared)
    keep = {f"{e['table']}.json" for e in entries}
    for old in (where / TABLES).glob("*.json"):
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return {"folder": str(folder), "shards": len(entries), "samples": total}


class Catalog:
    """The shards a ``Shards`` reads, from their index, packed in a few arrays and strings (about 70 bytes a
    shard: 7 MB for 10^5 shards in each process, not a dict per shard); each shard's table loaded on demand
    (``table``)."""

    def __init__(self, entries: list[tuple[Path, dict]], shared: bool = False) -> None:
        self.shared = shared
        folders = sorted({p.parent for p, _ in entries})
        self._folders, where = folders, {f: n for n, f in enumerate(folders)}
        self._folder = array("l", (where[p.parent] for p, _ in entries))
        self._names = "/".join(p.name for p, _ in entries)  # a shard's name never holds a "/"
        self._name_at = array("q", [0])
        for p, _ in entries:
            self._name_at.append(self._name_at[-1] + len(p.name) + 1)
        self._size = array("q", (e["size"] for _, e in entries))
        self._mtime = array("q", (e["mtime_ns"] for _, e in entries))
        self._digests = b"".join(
            bytes.fromhex(e["ends"]).rjust(8, b"\0") + bytes.fromhex(e["table"]) for _, e in entries
        )
        self.offsets = array("q", [0])  # first global sample id of each shard, then the total
        for _, e in entries:
            self.offsets.append(self.offsets[-1] + e["samples"])
        # What the data is, in one digest: the shards' names and order, each one's table (every sample's key, range
        # and hash) and count. A resume on data with another identity would draw another order (``dataset.Identity``).
        self.identity = xxhash.xxh3_128_hexdigest(self._names.encode() + self._digests[8:] + self.offsets.tobytes())

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def shards(self) -> int:
        return len(self._size)

    def name(self, shard: int) -> str:
        return self._names[self._name_at[shard] : self._name_at[shard + 1] - 1]

    def path(self, shard: int) -> Path:
        return self._folders[self._folder[shard]] / self.name(shard)

    def size(self, shard: int) -> int:
        return self._size[shard]

    @property
    def bytes(self) -> int:
        """All the shards' bytes."""
        return sum(self._size)

    def ends(self, shard: int) -> str:
        return self._digests[24 * shard : 24 * shard + 8].hex()

    def table_digest(self, shard: int) -> str:
        return self._digests[24 * shard + 8 : 24 * shard + 24].hex()

    def check(self) -> None:
        """Every shard still the one indexed (present, a plain file, same size and mtime): ``ShardError`` for the
        first that is not. The ends' hash is checked when a process opens the shard (``open``)."""
        for shard in range(self.shards):
            path = self.path(shard)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                raise ShardError(
                    f"shard {path} is missing (it is in the index): restore it, or run {command(path.parent)} "
                    "if it was removed on purpose"
                ) from None
            if not stat.S_ISREG(st.st_mode):
                raise ShardError(f"shard {path} is not a plain file (a symlink or device): replace it with the file")
            size = self._size[shard]
            if st.st_size != size or st.st_mtime_ns != self._mtime[shard]:
                what = f"{st.st_size} bytes, indexed at {size}" if st.st_size != size else "touched"
                raise ShardError(
                    f"shard {path} changed since it was indexed ({what}): restore it, or run "
                    f"{command(path.parent)} if the change is yours"
                )

    def open(self, shard: int, path: Path | None = None) -> int:
        """A read-only descriptor on ``shard`` (or on its staged copy at ``path``), once its size and ends still
        match the index."""
        path = path or self.path(shard)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        fresh = stat.S_ISREG(st.st_mode) and st.st_size == self._size[shard]
        if not fresh or tarscan.ends_hash(fd, st.st_size) != self.ends(shard):
            os.close(fd)
            raise ShardError(
                f"shard {path} changed since it was indexed (its size or its first or last bytes differ): restore "
                f"it, or run {command(self.path(shard).parent)} if the change is yours"
            )
        return fd

    def table(self, shard: int) -> Table:
        path, digest = self.path(shard), self.table_digest(shard)
        file = path.parent / FOLDER / TABLES / f"{digest}.json"
        data = _read_trusted(file, self.shared)
        if data is None or xxhash.xxh3_128_hexdigest(data) != digest:
            raise ShardError(f"{file} is missing or damaged: run {command(path.parent)} again")
        return checked_table(json.loads(data), self._size[shard], file)


def _read_trusted(path: Path, shared: bool) -> bytes | None:
    if not os.path.lexists(path):
        return None
    safefs.check_trusted(path, shared, use="read shards indexed by", published=True)
    return safefs.read_bytes(path, LIMIT)


def load(path: str | Path | list, shared: bool = False) -> Catalog:
    """The catalog of a folder of shards, or of a list of tar files (each listed in its folder's index).
    ``ShardUsageError`` names the command when an index is missing or older than the shards it lists."""
    wanted = [Path(p) for p in path] if isinstance(path, (list, tuple)) else None
    folders = sorted({p.parent for p in wanted}) if wanted else [Path(path)]
    indexed: dict[Path, dict] = {}
    for folder in folders:
        file = folder / FOLDER / INDEX
        if os.path.lexists(folder / FOLDER):
            safefs.check_trusted(folder / FOLDER, shared, use="read shards indexed by", published=True)
        data = _read_trusted(file, shared)
        if data is None:
            if not folder.is_dir():
                raise ShardUsageError(f"{folder} is not a folder of shards")
            raise ShardUsageError(f"{folder} has no shard index: run {command(folder)} once (not inside a job)")
        index = json.loads(unsealed(data, file))
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ShardUsageError(f"{file} is not an index of this format: run {command(folder)} again")
        for entry in checked_entries(index.get("shards"), file):
            indexed[folder / entry["name"]] = entry
        if wanted is None:
            on_disk = {p.name for p in folder.glob("*.tar")}
            new = sorted(on_disk - {e["name"] for e in index["shards"]})
            if new:
                raise ShardUsageError(f"{folder / new[0]} is not in the index: run {command(folder)} again")
    if wanted is None:
        return Catalog(list(indexed.items()), shared)
    missing = [p for p in wanted if p not in indexed]
    if missing:
        raise ShardUsageError(f"{missing[0]} is not in its folder's index: run {command(missing[0].parent)}")
    return Catalog([(p, indexed[p]) for p in wanted], shared)
