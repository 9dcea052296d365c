"""The order sharded data is visited in: a pure function of (seed, epoch, position), in O(shards) memory.

Epoch ``e`` shuffles the shards (a permutation of the shard numbers), cuts that order into windows of
``window`` shards, and permutes the positions inside each window. Position ``p`` of the epoch is computed
alone: find its window (a binary search over the shuffled shards' cumulative sample counts), permute its
offset in the window, find the shard and the sample that offset falls on. No list of N sample ids exists
anywhere, so the world size and the worker count cannot change the order, a resume needs no loader state
(the step says where), and a global batch reads the shards of at most two windows.

The permutations are Feistel networks keyed from (seed, epoch, window), on the smallest even number of bits
that covers the domain, made exact on ``[0, n)`` by cycle walking (a value outside is permuted again until it
falls inside: a bijection, and fewer than four rounds on average since the bit domain is under ``4n``).

Memory: the shards' first sample ids (the catalog's) and one epoch's cumulative counts in shuffled order, 8
bytes a shard each: 1.6 MB for 10^5 shards, whatever the number of samples (``tests/shards/test_order.py``
measures it at 10^9 samples).
"""

from __future__ import annotations

from array import array

import numpy as np

MASK64 = (1 << 64) - 1
ROUNDS = 6


def mix(x: int) -> int:
    """splitmix64's finalizer: a 64-bit hash with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """``mix`` on an array of uint64 (the products wrap modulo 2^64 as the masked ones above)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Feistel:
    """A keyed bijection on ``[0, n)``."""

    __slots__ = ("n", "half", "mask", "keys")

    def __init__(self, n: int, key: int) -> None:
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self.n, self.half, self.mask = n, bits // 2, (1 << bits // 2) - 1
        self.keys = [mix(key ^ mix(r + 1)) for r in range(ROUNDS)]

    def all(self) -> np.ndarray:
        """The whole permutation at once, ``[self(x) for x in range(n)]`` computed on arrays (an epoch of 10^5
        shards is set up in milliseconds, not a second)."""
        x = np.arange(self.n, dtype=np.uint64)
        todo = np.arange(self.n)
        while todo.size:
            y = self._rounds(x[todo])
            x[todo] = y
            todo = todo[y >= self.n]
        return x.astype(np.int64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self.half), np.uint64(self.mask)
        left, right = x >> half, x & mask
        for k in self.keys:
            left, right = right, left ^ (_mix_array(right ^ np.uint64(k)) & mask)
        return (left << half) | right

    def __call__(self, x: int) -> int:
        half, mask = self.half, self.mask
        while True:
            left, right = x >> half, x & mask
            for k in self.keys:
                left, right = right, left ^ (mix(right ^ k) & mask)
            x = (left << half) | right
            if x < self.n:
                return x


def key(seed: int, epoch: int, what: int) -> int:
    return mix(mix(mix(seed & MASK64) ^ epoch) ^ what)


SHARDS = 1 << 62  # the ``what`` of the shard shuffle's key (windows are numbered from 0)


class ShardOrder:
    """Global sample ids in epoch order. ``offsets``: the first global id of each shard, then the total
    (``index.Catalog.offsets``); ``window``: shards whose samples are mixed together."""

    def __init__(self, offsets: array, seed: int, window: int) -> None:
        if window < 1:
            raise ValueError(f"window={window}: a window holds at least one shard")
        self.offsets, self.seed, self.window = offsets, seed, window
        self.shards = len(offsets) - 1
        self._epoch: int | None = None
        self._cum = np.zeros(1, dtype=np.int64)
        self._shuffle: Feistel | None = None
        self._windows: dict[int, Feistel] = {}

    def __len__(self) -> int:
        return self.offsets[-1]

    def _at(self, epoch: int) -> None:
        if self._epoch == epoch:
            return
        shuffle = Feistel(self.shards, key(self.seed, epoch, SHARDS))
        offsets = np.frombuffer(self.offsets, dtype=np.int64)
        counts = np.diff(offsets)[shuffle.all()]  # the shards' sample counts in this epoch's shuffled order
        cum = np.zeros(self.shards + 1, dtype=np.int64)
        np.cumsum(counts, out=cum[1:])
        self._epoch, self._cum, self._shuffle, self._windows = epoch, cum, shuffle, {}

    def id(self, epoch: int, position: int) -> int:
        """The global sample id at ``position`` of ``epoch``."""
        self._at(epoch)
        cum, k = self._cum, self.window
        w = (int(np.searchsorted(cum, position, side="right")) - 1) // k
        first, last = int(cum[w * k]), int(cum[min((w + 1) * k, self.shards)])
        perm = self._windows.get(w)
        if perm is None:
            perm = self._windows[w] = Feistel(last - first, key(self.seed, epoch, w))
            if len(self._windows) > 4:  # a batch spans two windows at most
                self._windows.pop(next(iter(self._windows)))
        moved = first + perm(position - first)
        slot = int(np.searchsorted(cum, moved, side="right")) - 1
        shard = self._shuffle(slot)  # type: ignore[misc]
        return self.offsets[shard] + moved - int(cum[slot])

    def epoch(self, epoch: int) -> EpochOrder:
        """``epoch``'s order as a sequence (``order[a:b]`` is a list of ids), as the step sampler reads it."""
        return EpochOrder(self, epoch)


class EpochOrder:
    """One epoch of a ``ShardOrder``: indexable and sliceable, computed on demand."""

    def __init__(self, order: ShardOrder, epoch: int) -> None:
        self.order, self.epoch_number = order, epoch

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, where: int | slice) -> int | list[int]:
        if isinstance(where, slice):
            return [self.order.id(self.epoch_number, p) for p in range(*where.indices(len(self.order)))]
        return self.order.id(self.epoch_number, where)
