"""``ddp_slurm.Shards``: a folder of WebDataset tar shards as training or evaluation data.

A task returns ``Shards(path, decode)`` from ``train_data()`` or ``eval_data()``. The runtime draws the
epoch's order from ``order(seed)`` (``order.py``: a pure function of (seed, epoch, position)) and fetches a
rank's share of each global batch through its DataLoader workers like map-style data (``train/loader.py``):
the same global batches at any world size and worker count, exact mid-epoch resume, per-sample RNG seeds.

A sample is read by byte range (``os.pread``: no tar object per worker, no file position to share after a
fork): a worker asked for a batch sorts its samples by shard and offset and reads neighbours closer than
``GAP`` in one call (``raw``). Each sample's bytes are hashed and checked against the index before
``decode`` sees them; a shard is checked whole (size, mtime) when the data is opened, and at its ends when a
process first opens it. Open files and loaded tables are kept per process, a few windows' worth at most,
so a worker's memory does not grow with the samples it reads.

``readahead_mb``: the training process tells the kernel which byte ranges the next steps of this rank read
(``POSIX_FADV_WILLNEED``), up to that many bytes ahead. ``stage``: copy the shards to node-local disk first
(``True``: ``$SLURM_TMPDIR``; or a folder), each copy checked like the original.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash
from torch.utils.data import Dataset

from ddp_slurm import safefs
from ddp_slurm.shards import index
from ddp_slurm.shards.errors import ShardError, ShardUsageError
from ddp_slurm.shards.order import ShardOrder
from ddp_slurm.train.checkpoint.parts import Part

GAP = 64 << 10  # samples of one shard closer than this are read in one pread (the gap read and dropped)
AHEAD_GAP = 1 << 20  # read-ahead hints closer than this are one hint: one long read for the disk


class Shards(Dataset):
    """WebDataset tar shards, indexed (``ddp-slurm data index DIR``), as a task's data.

    ``path``: a folder of ``*.tar`` shards or a list of tar files. ``decode(sample)``: ``sample`` maps each
    member's extension (``"jpg"``, ``"cls"``) to its bytes, plus ``"__key__"``; it returns the tuple of
    tensors a batch is collated from. ``window``: shards whose samples are shuffled together (more mixes
    better, each global batch then touches more files). ``readahead_mb`` and ``stage``: module docstring.
    ``shared``: the index may be writable by the group (a team's data, as with ``run.shared``).
    """

    def __init__(
        self,
        path: str | Path | list,
        decode: Callable[[dict[str, Any]], Any],
        *,
        window: int = 8,
        readahead_mb: float = 64,
        stage: bool | str | Path = False,
        shared: bool = False,
    ) -> None:
        if not isinstance(window, int) or window < 1:
            raise ShardUsageError(f"Shards(window={window!r}): a window holds a whole number of shards, 1 or more")
        if not 0 <= readahead_mb < 1 << 20:  # NaN fails both
            raise ShardUsageError(f"Shards(readahead_mb={readahead_mb!r}): expected megabytes, 0 (off) or more")
        self.decode, self.window, self.readahead = decode, window, int(readahead_mb * (1 << 20))
        self.catalog = index.load(path, shared)
        self.catalog.check()
        self.staged: list[Path] | None = None  # where the bytes are read from, when not the shards themselves
        if stage:
            self.staged = _stage(self.catalog, os.environ.get("SLURM_TMPDIR", "") if stage is True else stage)
        self._pid = -1
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._tables: OrderedDict[int, index.Table] = OrderedDict()

    def __len__(self) -> int:
        return len(self.catalog)

    def __getitem__(self, gid: int) -> Any:
        return self.decode(self.raw([gid])[0])

    def parts(self) -> list[Part]:
        """What the checkpoint keeps of the data: its identity (``Identity``)."""
        return [Identity(self.catalog.identity, str(self.catalog.path(0).parent))]

    def order(self, seed: int) -> ShardOrder:
        """The training order (``order.py``) for the run's seed."""
        return ShardOrder(self.catalog.offsets, seed, self.window)

    def locate(self, gid: int) -> tuple[int, int]:
        """(shard number, sample number in it) of global sample id ``gid``."""
        if not 0 <= gid < len(self.catalog):
            raise IndexError(f"sample {gid} of {len(self.catalog)}")
        shard = bisect_right(self.catalog.offsets, gid) - 1
        return shard, gid - self.catalog.offsets[shard]

    def name(self, gid: int) -> str:
        """``shard.tar:key``: how the guard and the log name a sample."""
        shard, i = self.locate(gid)
        return f"{self.catalog.name(shard)}:{self._table(shard).keys[i]}"

    def index_of(self, name: str) -> int:
        """The global sample id of ``shard.tar:key`` (``guard.drop`` by name); ShardUsageError when there is none."""
        shard_name, _, key = name.partition(":")
        shards = [n for n in range(self.catalog.shards) if self.catalog.name(n) == shard_name]
        keys = self._table(shards[0]).keys if shards else []
        if key not in keys:
            raise ShardUsageError(f"guard.drop names {name}: no such sample in these shards (names are shard.tar:key)")
        return self.catalog.offsets[shards[0]] + keys.index(key)

    def raw(self, gids: list[int]) -> list[dict[str, Any]]:
        """The samples ``gids`` as ``{ext: bytes, "__key__": key}``, in the order asked, each checked against its
        hash; neighbours in one shard read together."""
        where = sorted((*self.locate(g), n) for n, g in enumerate(gids))
        out: list[dict[str, Any]] = [{}] * len(gids)
        run: list[tuple[int, int, int]] = []
        for shard, i, n in where:
            if run and (run[0][0] != shard or self._table(shard).start[i] - self._end(run[-1]) > GAP):
                self._read(run, out)
                run = []
            run.append((shard, i, n))
        if run:
            self._read(run, out)
        return out

    def readahead_hint(self, gids: list[int]) -> int:
        """Ask the kernel to start reading the samples ``gids`` (the training process, steps ahead): ranges of
        one shard closer than ``AHEAD_GAP`` are hinted as one, so the disk sees a few long reads rather than a
        request per sample (the gaps cost bytes, which are cheap next to requests). The bytes hinted."""
        hinted, run = 0, None  # run: (shard, first byte, last byte) being merged
        for shard, i in sorted(self.locate(g) for g in gids):
            t = self._table(shard)
            if run and run[0] == shard and t.start[i] - run[2] <= AHEAD_GAP:
                run = (shard, run[1], max(run[2], t.end[i]))
                continue
            if run:
                hinted += self._hint(*run)
            run = (shard, t.start[i], t.end[i])
        return hinted + (self._hint(*run) if run else 0)

    def _hint(self, shard: int, first: int, last: int) -> int:
        os.posix_fadvise(self._fd(shard), first, last - first, os.POSIX_FADV_WILLNEED)
        return last - first

    def _end(self, item: tuple[int, int, int]) -> int:
        return self._table(item[0]).end[item[1]]

    def _read(self, run: list[tuple[int, int, int]], out: list[dict[str, Any]]) -> None:
        shard = run[0][0]
        t = self._table(shard)
        first, last = t.start[run[0][1]], t.end[run[-1][1]]
        data = os.pread(self._fd(shard), last - first, first)
        for _, i, n in run:
            chunk = memoryview(data)[t.start[i] - first : t.end[i] - first]
            if len(chunk) != t.end[i] - t.start[i] or xxhash.xxh3_64_hexdigest(chunk) != t.hash[i]:
                raise ShardError(
                    f"sample {self.catalog.name(shard)}:{t.keys[i]} does not match its index (shard "
                    f"{self.catalog.path(shard)} was changed or damaged): restore the shard, or run "
                    f"{index.command(self.catalog.path(shard).parent)} if the change is yours"
                )
            sample: dict[str, Any] = {"__key__": t.keys[i]}
            for ext, offset, size in t.members[i]:
                sample[ext] = bytes(chunk[offset : offset + size])
            out[n] = sample

    def _own(self) -> None:
        """Caches belong to one process: a forked worker starts its own (the parent's descriptors it inherited
        are left to the parent)."""
        if self._pid != os.getpid():
            self._pid, self._fds, self._tables = os.getpid(), OrderedDict(), OrderedDict()

    def _keep(self) -> int:
        return 2 * self.window + 2  # two windows (a batch spans two at most) and a little slack

    def _fd(self, shard: int) -> int:
        self._own()
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = self.catalog.open(shard, self.staged[shard] if self.staged else None)
            if len(self._fds) > self._keep():
                os.close(self._fds.popitem(last=False)[1])
        self._fds.move_to_end(shard)
        return fd

    def _table(self, shard: int) -> index.Table:
        self._own()
        table = self._tables.get(shard)
        if table is None:
            table = self._tables[shard] = self.catalog.table(shard)
            if len(self._tables) > self._keep():
                self._tables.popitem(last=False)
        self._tables.move_to_end(shard)
        return table


class Identity(Part):
    """The shards a run trains on, by digest (``Catalog.identity``), in every checkpoint: a resume on shards
    written or indexed again since (other samples, another split into shards) would silently train another
    order, so it is refused in one line (exit 2). A checkpoint without it (not sharded data) is not judged."""

    optional = {"data_identity": ((lambda v: isinstance(v, str)), "a digest")}

    def __init__(self, digest: str, where: str) -> None:
        self.digest, self.where = digest, where

    def take(self, now: Any) -> dict[str, Any]:
        return {"data_identity": self.digest}

    def put(self, saved: dict[str, Any], how: Any) -> None:
        if saved.get("data_identity", self.digest) != self.digest:
            raise ShardUsageError(
                f"the shards under {self.where} are not the ones {how.what} was trained on (written or indexed again "
                "since): resume with those shards, or start a new run (another run.name) on these"
            )


def _stage(catalog: index.Catalog, folder: str | Path) -> list[Path]:
    """Copies of the shards under ``folder`` (node-local disk): a copy is written under an exclusive temporary
    name and renamed, and one already there is kept when its size and ends match the index (``Catalog.open``
    checks them again whenever a process opens it). The ranks of one node take turns on a POSIX lock
    (``.staging-lock`` beside the copies): the first copies, the others wait and find the copies made. The kernel
    drops the lock of a rank that dies, so a killed job never leaves the folder locked."""
    if not str(folder):
        raise ShardUsageError(
            "Shards(stage=True) needs $SLURM_TMPDIR (set inside a Slurm job): pass stage=FOLDER instead"
        )
    into = Path(folder) / "ddp-slurm-shards"
    safefs.make_dir(into)  # a planted link there is refused
    lock = safefs.open_owned(into / ".staging-lock", os.O_RDWR)  # a symlink or another user's file is refused
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX)  # a POSIX lock: it belongs to this process, not to forked workers
        copies = []
        for shard in range(catalog.shards):
            copy = into / f"{catalog.table_digest(shard)[:16]}-{catalog.name(shard)}"
            try:
                os.close(catalog.open(shard, copy))  # there already, and the one indexed
            except (FileNotFoundError, ShardError):
                with catalog.path(shard).open("rb") as src:  # an exclusive, unguessable temporary renamed into place
                    safefs.write_atomic(copy, lambda f, src=src: shutil.copyfileobj(src, f, 16 << 20))
            copies.append(copy)
        return copies
    finally:
        os.close(lock)  # closing drops the lock
