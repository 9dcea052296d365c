"""The data of ``bench shards``: the same samples one file each and in shards, and what a pass reads from disk.

A sample is ``<i>.bin``: its number ``i`` (8 bytes, little-endian: the label, so both sides can be shown
to read the same samples) then ``payload`` seeded random bytes. ``Files`` reads it map-style (open and read
one file per sample); ``decode`` turns a shard's sample into the same ``(payload, label)`` tensors.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp_slurm.bench import common

LABEL = 8  # bytes of the label in front of a sample's payload


def write_files(folder: Path, count: int, payload: int, seed: int) -> float:
    """``count`` samples as ``folder/<i>.bin`` (seeded: the same bytes for the same arguments); the seconds
    it took. Each file is flushed to disk, so its pages can be dropped from the cache."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for i in range(count):
        fd = os.open(folder / f"{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, i.to_bytes(LABEL, "little") + rng.bytes(payload))
        finally:
            os.close(fd)
    os.sync()  # dirty pages cannot be dropped: everything on disk before the first pass
    return time.perf_counter() - start


def write_shards(files: Path, out: Path, per_shard: int) -> tuple[float, int]:
    """The samples of ``files`` as indexed shards in ``out`` through the runtime's writer
    (``ddp_slurm.shards.write``); (seconds, shards)."""
    from ddp_slurm.shards.write import write

    start = time.perf_counter()
    summary = write(str(files), out, per_shard=per_shard)
    os.sync()
    return time.perf_counter() - start, int(summary["shards"])


def small_shards(folder: Path, shards: int = 200, per_shard: int = 50) -> Path:
    """Many small shards (a JSONL list of tiny samples through the writer): what ``memory_flatness`` reads."""
    from ddp_slurm.shards.write import write

    folder.mkdir(parents=True)
    rows = "".join(f'{{"__key__": "{i}", "cls": {i}}}\n' for i in range(shards * per_shard))
    (folder / "list.jsonl").write_text(rows)
    write(str(folder / "list.jsonl"), folder / "shards", shards=shards)
    return folder / "shards"


def check_space(folder: Path, count: int, payload: int) -> None:
    """BenchError when ``folder``'s disk cannot take both layouts (a file takes whole 4 KiB blocks, a shard
    member a 512-byte header and padding) with a margin."""
    need = count * (2 * (LABEL + payload) + 4096 + 2048) + (64 << 20)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise common.BenchError(
            f"--count {count} --payload {payload} needs about {need / 2**20:,.0f} MiB in {folder}, which has "
            f"{free / 2**20:,.0f} MiB free: choose smaller sizes or another --dir"
        )


def to_tensors(data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's bytes as (payload uint8 tensor, label)."""
    label = int.from_bytes(data[:LABEL], "little")
    return torch.frombuffer(bytearray(data[LABEL:]), dtype=torch.uint8), torch.tensor(label)


def decode(sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``Shards``' decode: the ``bin`` member, as ``Files`` returns it."""
    return to_tensors(sample["bin"])


class Files(Dataset):
    """Map-style reading: ``dataset[i]`` opens ``folder/<i>.bin`` and reads it whole."""

    def __init__(self, folder: Path, count: int) -> None:
        self.folder, self.count = str(folder), count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with open(f"{self.folder}/{i}.bin", "rb", buffering=0) as f:
            return to_tensors(f.read())

    def paths(self) -> list[Path]:
        return [Path(self.folder) / f"{i}.bin" for i in range(self.count)]


def shard_paths(folder: Path) -> list[Path]:
    """What a ``Shards`` pass reads: the shards, their index and tables."""
    return [p for p in sorted(folder.rglob("*")) if p.is_file()]


def drop_cache(paths: list[Path]) -> None:
    """Evict each file's pages from the page cache (``POSIX_FADV_DONTNEED``, no root needed). Inodes,
    directory entries and directory blocks stay cached: this cannot drop them."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_bytes() -> int | None:
    """``read_bytes`` of ``/proc/self/io``: bytes this process, and the children it has reaped, had the
    block layer read for them (page-cache misses, kernel read-ahead and metadata blocks included);
    None where the kernel does not count it."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split(":")[1])
    except OSError:
        return None
    return None


def _cgroup_files(v1: tuple[str, ...], v2: str, root: bool = False) -> list[Path]:
    """This process's cgroup's ``v1`` files (blkio hierarchy) or ``v2`` file (unified) that exist; the root
    group (every process of the machine) only with ``root``."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        group = group.strip().lstrip("/")
        if not group and not root:
            continue  # the root group holds every process of the machine: not this command's reads
        if "blkio" in controllers.split(","):
            found += [Path("/sys/fs/cgroup/blkio") / group / name for name in v1]
        elif controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").is_file():
            found.append(Path("/sys/fs/cgroup") / group / v2)
    return [f for f in found if f.is_file()]


def cgroup_read_requests() -> int | None:
    """Read requests (bios) the disk was sent by this process's own cgroup (``benchmarks/throttled_disk.sh``
    puts the command alone in one): v1 ``blkio.throttle.io_serviced``, v2 ``io.stat`` ``rios``; None in the
    root group, whose counts are the whole machine's."""
    for file in _cgroup_files(("blkio.throttle.io_serviced",), "io.stat"):
        total = 0
        for line in file.read_text().splitlines():
            words = line.split()
            if len(words) == 3 and words[1] == "Read":
                total += int(words[2])
            total += sum(int(w[5:]) for w in words if w.startswith("rios="))
        return total
    return None


def read_throttle() -> list[str]:
    """The read limits of the cgroup this process runs in (``benchmarks/throttled_disk.sh --read``):
    cgroup v1 ``blkio.throttle.read_*_device`` lines or v2 ``io.max`` lines; empty when there is none."""
    v1 = tuple(f"blkio.throttle.read_{k}_device" for k in ("bps", "iops"))
    found = []
    for file in _cgroup_files(v1, "io.max", root=True):
        try:
            found += [f"{file.name}: {x}" for x in file.read_text().split("\n") if x.strip()]
        except OSError:
            pass
    return found


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_flatness(folder: Path, reads: int, seed: int, batch: int) -> dict[str, Any]:
    """Read ``reads`` samples of the shards in ``folder`` through ``Shards.raw`` in the training order,
    epoch after epoch, in this process; RSS and the ``Shards``' caches after a tenth of them and after all."""
    from ddp_slurm.shards.dataset import Shards

    shards = Shards(folder, decode)
    order, done, epoch, marks = shards.order(seed), 0, 0, []
    while done < reads:
        positions = order.epoch(epoch)
        for a in range(0, len(shards), batch):
            gids: list[int] = positions[a : a + min(batch, reads - done)]  # type: ignore[assignment]
            shards.raw(gids)
            done += len(gids)
            if not marks and done >= reads // 10:
                marks.append(_mark(shards, done))
            if done >= reads:
                if len(marks) < 2:
                    marks.append(_mark(shards, done))
                break
        epoch += 1
    return {
        "samples": len(shards),
        "shards": shards.catalog.shards,
        "window": shards.window,
        "marks": marks,
        "rss_growth_bytes": marks[-1]["rss_bytes"] - marks[0]["rss_bytes"],
    }


def _mark(shards: Any, done: int) -> dict[str, Any]:
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    return {
        "reads": done,
        "rss_bytes": rss_bytes(),
        "open_fds": fds,
        "cached_shard_fds": len(shards._fds),
        "cached_tables": len(shards._tables),
    }
