"""Where each rank's batches come from: the in-memory fast path, or a map-style Dataset through workers.

Both paths draw the same global order: epoch ``e`` visits the samples in ``randperm(N)`` seeded from
``(run.seed, e)``, global batch ``s`` is the slice ``[s*G, (s+1)*G)`` of that order, and rank ``r`` takes
its ``G / world_size`` consecutive samples of it. The order is a pure function of (seed, epoch, step),
so resuming at step ``s`` is exact with no state at all, at any world size: the same global batches,
split among however many ranks there now are. The ragged tail of an epoch is dropped (unequal batches
would change the math between world sizes). Samples the guard found bad (``drop``: dataset index -> the
epoch it was found in) are left out of their global batch from that epoch on; every other sample keeps its
place, so the order stays a pure function of (seed, epoch, step) and the guard's record.

``InMemory`` (``Tensors``): the tensors live on the device; a batch is one ``index_select`` per tensor.

``DatasetBatches`` (any map-style ``Dataset``): torch's ``DataLoader`` with worker processes, pinned
memory and prefetch, fed by ``StepSampler`` (the order above, from any step). ``Shards`` (WebDataset tar
shards) take the same path with their own order (``shards/order.py``: shards shuffled, positions permuted
inside windows of shards, each position computed alone in O(shards) memory) in place of ``randperm(N)``;
every rule here holds for them unchanged. Randomness inside
``dataset[i]`` (augmentation) is exact too: each sample is fetched with python's, numpy's and torch's
RNGs seeded from ``(seed, epoch, i)``, so a sample gets the same draw whichever worker, rank or restart
fetches it. Why not torchdata's ``StatefulDataLoader``: its state belongs to one rank and one worker
count (it refuses another ``num_workers``), and its workers reseed from ``base_seed + worker_id`` when
a resumed iterator starts, so an augmentation drawn in a worker after a mid-epoch resume differs from
the uninterrupted run. A sampler addressed by (epoch, step) plus per-sample seeds needs no loader state
at all and resumes exactly at any world size and worker count (docs/tasks.md, "Resume").
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from ddp_slurm.train import rng
from ddp_slurm.train.task import Tensors

AHEAD_STEPS = 32  # read-ahead never looks further (the DataLoader's own prefetch covers the nearest steps)
PERMUTATION_STRIDE = 1_000_003  # (seed, epoch) -> one generator seed; epochs never collide below 10^6


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's global order: a pure function of (seed, epoch), the same on every rank and restart."""
    gen = torch.Generator().manual_seed(seed * PERMUTATION_STRIDE + epoch)
    return torch.randperm(num_samples, generator=gen)


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Full global batches only: a ragged last batch would give ranks unequal work and change the math."""
    return num_samples // global_batch


def rank_slice(step_in_epoch: int, global_batch: int, rank: int, world_size: int) -> slice:
    """Positions in the epoch's order that this rank trains on at ``step_in_epoch``."""
    per_rank = global_batch // world_size
    start = step_in_epoch * global_batch + rank * per_rank
    return slice(start, start + per_rank)


def eval_shard(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous [start, stop) of the evaluation set for this rank: every sample once, no padding."""
    return num_samples * rank // world_size, num_samples * (rank + 1) // world_size


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device`` without waiting (pinned memory allows it)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    items = batch.values() if isinstance(batch, dict) else batch
    return batch_size_of(next(iter(items)))


def kept_steps(epoch: int, start_step: int, per_epoch: int, skip: Callable[[int], bool] | None) -> list[int]:
    """The steps in the epoch (from ``start_step``) whose batches are trained: ``skip(step)`` (the run's
    skipped steps, counted over epochs from 1 as the log counts them, see ``skips.py``) drops the others."""
    steps = range(start_step, per_epoch)
    return list(steps) if skip is None else [s for s in steps if not skip(epoch * per_epoch + s + 1)]


def dropped(drop: dict[int, int], epoch: int) -> set[int]:
    """The dataset indices left out of ``epoch``: the bad samples found in it or before."""
    return {index for index, found in drop.items() if found <= epoch}


class InMemory:
    """Batches gathered by index from tensors held on the device: no workers, no per-sample Python."""

    def __init__(self, data: Tensors, device: torch.device, seed: int, global_batch: int, rank: int, world: int):
        self.data, self.device = data.to(device), device
        self.seed, self.global_batch, self.rank, self.world = seed, global_batch, rank, world
        self.steps_per_epoch = steps_per_epoch(len(data), global_batch)
        self.skip: Callable[[int], bool] | None = None  # the run's skipped steps (set by the guard)
        self.drop: dict[int, int] = {}  # the bad samples (set by the guard): dataset index -> epoch found

    def epoch(self, epoch: int, start_step: int) -> Iterator[tuple[torch.Tensor, ...]]:
        host = epoch_permutation(len(self.data), self.seed, epoch)
        bad = dropped(self.drop, epoch)
        keep = ~torch.isin(host, torch.tensor(sorted(bad), dtype=host.dtype)) if bad else None  # on the host
        order = host.pin_memory() if self.device.type == "cuda" else host  # pinned: the copy is queued, no sync
        order = order.to(self.device, non_blocking=True)  # indices on the device
        for step in kept_steps(epoch, start_step, self.steps_per_epoch, self.skip):
            where = rank_slice(step, self.global_batch, self.rank, self.world)
            if keep is not None and not bool(keep[where].all()):  # a bad sample in this slice: left out
                index = host[where][keep[where]]
                index = (index.pin_memory() if self.device.type == "cuda" else index).to(self.device, non_blocking=True)
            else:
                index = order[where]
            yield tuple(t.index_select(0, index) for t in self.data.tensors)

    def samples(self, epoch: int, step: int) -> list[tuple[int, Any]]:
        """This rank's samples of ``step`` (in the epoch) one by one: (dataset index, a batch of one)."""
        ids = epoch_permutation(len(self.data), self.seed, epoch)[
            rank_slice(step, self.global_batch, self.rank, self.world)
        ]
        return [(i, tuple(t[i : i + 1] for t in self.data.tensors)) for i in ids.tolist()]


Order = Callable[[int], Sequence[int]]  # epoch -> its order: order[a:b] is the list of dataset indices there


def permutation_order(num_samples: int, seed: int) -> Order:
    """Map-style data's order: ``epoch_permutation`` as a list."""
    return lambda epoch: epoch_permutation(num_samples, seed, epoch).tolist()


class StepSampler:
    """Batch sampler: this rank's ``(epoch, index)`` lists for the steps of one epoch from a start step.
    ``order``: the epoch's order (``permutation_order`` unless the data brings its own); ``ahead(ids, n)``,
    when given, is told the indices of the step ``n`` steps after the one being yielded (read-ahead)."""

    def __init__(
        self, num_samples: int, seed: int, global_batch: int, rank: int, world: int, order: Order | None = None
    ) -> None:
        self.num_samples, self.seed, self.global_batch, self.rank, self.world = (
            num_samples,
            seed,
            global_batch,
            rank,
            world,
        )
        self.order = order or permutation_order(num_samples, seed)
        self.ahead: Callable[[list[int]], int] | None = None
        self.ahead_steps = 0
        self.epoch, self.start_step = 0, 0
        self.skip: Callable[[int], bool] | None = None  # the run's skipped steps (set by the guard)
        self.drop: dict[int, int] = {}  # the bad samples (set by the guard): dataset index -> epoch found

    def set_position(self, epoch: int, start_step: int) -> None:
        self.epoch, self.start_step = epoch, start_step

    def ids(self, epoch: int, step: int) -> list[int]:
        """This rank's dataset indices at ``step`` of ``epoch`` (before the bad samples are left out)."""
        return list(self.order(epoch)[rank_slice(step, self.global_batch, self.rank, self.world)])

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        order = self.order(self.epoch)
        bad = dropped(self.drop, self.epoch)
        steps = self._steps()
        for n, step in enumerate(steps):
            ids = order[rank_slice(step, self.global_batch, self.rank, self.world)]
            chunk = max(1, self.ahead_steps // 2)
            if self.ahead is not None and n % chunk == 0:  # read ahead a chunk of steps at once: long reads
                later = steps[n + 1 : n + 2 * chunk] if n == 0 else steps[n + chunk : n + 2 * chunk]
                ahead = [i for s in later for i in order[rank_slice(s, self.global_batch, self.rank, self.world)]]
                if ahead:
                    self.ahead(ahead)
            yield [(self.epoch, i) for i in ids if i not in bad]

    def __len__(self) -> int:
        return len(self._steps())

    def _steps(self) -> list[int]:
        per_epoch = steps_per_epoch(self.num_samples, self.global_batch)
        return kept_steps(self.epoch, self.start_step, per_epoch, self.skip)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The RNG seed ``dataset[index]`` is fetched with in ``epoch``: independent of worker and rank."""
    return (seed * PERMUTATION_STRIDE + epoch) * 2_147_483_647 + index & 0xFFFF_FFFF_FFFF


class SeededSamples(Dataset):
    """Fetches ``dataset[i]`` for ``(epoch, i)`` with every RNG seeded from ``(seed, epoch, i)``."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        """A batch at once (torch's fetcher asks for it this way): data that reads neighbours together
        (``Shards.raw``) reads the batch's bytes first, then each sample is decoded with its own seeds."""
        raw = getattr(self.dataset, "raw", None)
        if raw is None:
            return [self[key] for key in keys]
        samples = raw([index for _, index in keys])
        return [
            self._seeded(epoch, index, self.dataset.decode, sample) for (epoch, index), sample in zip(keys, samples)
        ]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        return self._seeded(epoch, index, self.dataset.__getitem__, index)

    def _seeded(self, epoch: int, index: int, fetch: Callable[[Any], Any], arg: Any) -> Any:
        if get_worker_info() is not None:  # a worker process: its RNG streams are its own to reseed
            _seed_all(sample_seed(self.seed, epoch, index))
            return fetch(arg)
        saved = rng.capture()  # train.workers=0: this is the training process, whose streams are checkpointed
        try:
            _seed_all(sample_seed(self.seed, epoch, index))
            return fetch(arg)
        finally:
            rng.restore(saved)


def _seed_all(s: int) -> None:
    random.seed(s)
    torch.default_generator.manual_seed(s)  # CPU only: torch.manual_seed also queues lazy CUDA/XPU/MTIA seeds (~0.8 ms)
    try:
        import numpy as np
    except ImportError:  # numpy is optional for tasks
        return
    np.random.seed(s & 0xFFFF_FFFF)


class DatasetBatches:
    """A map-style Dataset through DataLoader worker processes, pinned memory and prefetch."""

    def __init__(
        self,
        dataset: Dataset,
        device: torch.device,
        seed: int,
        global_batch: int,
        rank: int,
        world: int,
        *,
        workers: int,
        prefetch: int,
    ) -> None:
        from torch.utils.data import DataLoader

        self.device, self.global_batch, self.world = device, global_batch, world
        self.dataset = dataset
        own = dataset.order(seed).epoch if hasattr(dataset, "order") else None  # Shards bring their own order
        self.sampler = StepSampler(len(dataset), seed, global_batch, rank, world, own)  # type: ignore[arg-type]
        if hasattr(dataset, "readahead_hint") and dataset.readahead > 0:
            per_step = max(1, global_batch // world) * max(1, _sample_bytes(dataset))
            steps = min(AHEAD_STEPS, max(1, dataset.readahead // per_step))
            self.sampler.ahead, self.sampler.ahead_steps = dataset.readahead_hint, steps
        self.steps_per_epoch = steps_per_epoch(len(dataset), global_batch)  # type: ignore[arg-type]
        self.loader = DataLoader(
            SeededSamples(dataset, seed),
            batch_sampler=self.sampler,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            prefetch_factor=prefetch if workers else None,
            persistent_workers=workers > 0,
            # The workers' base seed from a generator of its own: drawn from the global stream, it would
            # shift this rank's dropout stream by one draw at a resume (the loader starts mid-epoch).
            generator=torch.Generator().manual_seed(seed),
        )

    @property
    def skip(self) -> Callable[[int], bool] | None:
        return self.sampler.skip

    @skip.setter
    def skip(self, skip: Callable[[int], bool] | None) -> None:
        self.sampler.skip = skip

    @property
    def drop(self) -> dict[int, int]:
        return self.sampler.drop

    @drop.setter
    def drop(self, drop: dict[int, int]) -> None:
        self.sampler.drop = drop

    def samples(self, epoch: int, step: int) -> list[tuple[int, Any]]:
        """This rank's samples of ``step`` (in the epoch) one by one: (dataset index, a batch of one), fetched
        with the seeds a worker uses (``SeededSamples``), in this process."""
        from torch.utils.data import default_collate

        seeded = SeededSamples(self.dataset, self.sampler.seed)
        return [
            (i, to_device(default_collate([seeded[(epoch, i)]]), self.device)) for i in self.sampler.ids(epoch, step)
        ]

    def parts(self) -> list[Any]:
        """The checkpoint parts the data registers (``Shards``: its identity), none for other datasets."""
        return list(self.dataset.parts()) if hasattr(self.dataset, "parts") else []

    def name(self, index: int) -> str:
        """How a sample is named to people: ``shard.tar:key`` for shards, the dataset index otherwise."""
        return self.dataset.name(index) if hasattr(self.dataset, "name") else str(index)

    def epoch(self, epoch: int, start_step: int) -> Iterator[Any]:
        self.sampler.set_position(epoch, start_step)  # read when the loader's iterator starts
        for batch in self.loader:
            yield to_device(batch, self.device)

    def close(self) -> None:
        """Stop the worker processes now (they are persistent: they would live until the loader is freed)."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def _sample_bytes(dataset: Any) -> int:
    """A sample's mean size on disk (sharded data): what read-ahead in bytes is counted in."""
    return dataset.catalog.bytes // max(1, len(dataset))


def make_batches(data: Any, device: torch.device, seed: int, global_batch: int, rank: int, world: int, *, cfg: Any):
    """The batch source for ``data`` (Tensors or a map-style Dataset); ``cfg`` is the ``train`` section."""
    if isinstance(data, Tensors):
        return InMemory(data, device, seed, global_batch, rank, world)
    if isinstance(data, Dataset) or hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return DatasetBatches(data, device, seed, global_batch, rank, world, workers=cfg.workers, prefetch=cfg.prefetch)
    raise TypeError(f"train_data() returned {type(data).__name__}: expected ddp_slurm.Tensors or a map-style Dataset")


def eval_batches(data: Any, device: torch.device, rank: int, world: int, batch: int, workers: int) -> Iterator[Any]:
    """This rank's contiguous shard of the evaluation data, in batches (every sample once overall)."""
    if isinstance(data, Tensors):
        start, stop = eval_shard(len(data), rank, world)
        for i in range(start, stop, batch):
            yield tuple(t[i : min(i + batch, stop)] for t in data.tensors)
        return
    from torch.utils.data import DataLoader, Subset

    start, stop = eval_shard(len(data), rank, world)
    loader = DataLoader(
        Subset(data, range(start, stop)), batch_size=batch, num_workers=workers, pin_memory=device.type == "cuda"
    )
    for b in loader:
        yield to_device(b, device)
