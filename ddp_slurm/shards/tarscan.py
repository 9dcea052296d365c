"""One pass over a plain (uncompressed) WebDataset tar: where each sample's bytes lie, and their hash.

A WebDataset sample is the run of members ``<key>.<ext>`` sharing one key (the member's path up to the
first dot of its file name); one sample's members must be contiguous. A sample's bytes are the range from
its first member's header to its last member's data: read back with one ``pread``, hashed (XXH3-64) when
indexed and again when read, then cut into members by the offsets recorded here. Compressed tars are
refused: a gzip stream has no random access, so a sample could only be reached by decompressing
everything before it.
"""

from __future__ import annotations

import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from ddp_slurm.shards.errors import ShardError

# The first bytes of the compressed formats ``tar`` writes: named in the refusal.
COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"\x04\x22\x4d\x18": "lz4",
}
_KEY = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]+)$")  # webdataset's split: key up to the first dot of the name
ENDS = 4096  # bytes at each end of a shard whose hash the index keeps (a cheap check at start)


@dataclass
class Sample:
    """One sample of a shard: its key, byte range ``[start, end)``, hash, and members ``(ext, offset from
    start, size)``."""

    key: str
    start: int
    end: int = 0
    hash: str = ""
    members: list[tuple[str, int, int]] = field(default_factory=list)


def split_name(name: str) -> tuple[str, str] | None:
    """``("dir/000012", "jpg")`` for ``dir/000012.jpg``; None for a name without an extension (skipped, as
    webdataset skips it)."""
    m = _KEY.match(name)
    return (m.group(1), m.group(2)) if m else None


def refuse_compressed(path: Path, head: bytes) -> None:
    """``ShardError`` when ``head`` (a shard's first bytes) starts a compressed stream."""
    for magic, kind in COMPRESSED.items():
        if head.startswith(magic):
            raise ShardError(
                f"{path} is a {kind}-compressed tar: shards must be plain tars (a compressed one has no random "
                f"access); decompress it, then run `ddp-slurm data index {path.parent}` again"
            )


def ends_hash(fd: int, size: int) -> str:
    """The hash of a shard's first and last ``ENDS`` bytes: a file cut, grown or rewritten at either end
    differs here without reading it whole."""
    h = xxhash.xxh3_64()
    h.update(os.pread(fd, min(ENDS, size), 0))
    h.update(os.pread(fd, min(ENDS, size), max(0, size - ENDS)))
    return h.hexdigest()


def scan(path: Path) -> list[Sample]:
    """Every sample of the tar at ``path``, in file order, hashed. ``ShardError`` names what is wrong: not a
    tar, compressed, a sample's members apart, a member twice, a link or device inside."""
    path = Path(path)
    with path.open("rb") as f:
        refuse_compressed(path, f.read(8))
        f.seek(0)
        try:
            samples = _members(path, tarfile.open(fileobj=f, mode="r:"))
        except tarfile.TarError as exc:
            raise ShardError(
                f"{path} is not a readable tar ({exc}): write shards with `ddp-slurm data write`"
            ) from None
        fd = f.fileno()
        for s in samples:
            data = os.pread(fd, s.end - s.start, s.start)
            s.hash = xxhash.xxh3_64_hexdigest(data)
    return samples


def _members(path: Path, tar: tarfile.TarFile) -> list[Sample]:
    samples: list[Sample] = []
    seen: set[str] = set()
    for info in tar:
        if info.isdir():
            continue
        if not info.isreg():
            raise ShardError(f"{path}: member {info.name!r} is not a regular file (a link or device): not a shard")
        parts = split_name(info.name)
        if parts is None:
            continue
        key, ext = parts
        if not samples or samples[-1].key != key:
            if key in seen:
                raise ShardError(
                    f"{path}: the members of sample {key!r} are not together (WebDataset needs each sample's "
                    "files contiguous); rewrite the shards with `ddp-slurm data write`"
                )
            seen.add(key)
            samples.append(Sample(key, info.offset))
        s = samples[-1]
        if any(e == ext for e, _, _ in s.members):
            raise ShardError(f"{path}: sample {key!r} holds .{ext} twice")
        s.members.append((ext, info.offset_data - s.start, info.size))
        s.end = info.offset_data + info.size
    return samples
