"""train/loader.py: the global order, its sharding, and the Dataset path's exactness (real DataLoader workers)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from ddp_slurm.train import loader
from ddp_slurm.train.task import Tensors

CPU = torch.device("cpu")


class Augmented(Dataset):
    """Each sample draws from torch's RNG (an augmentation) and reports its own index."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.rand(3)


def _collect(batches: loader.DatasetBatches | loader.InMemory, epoch: int, start: int) -> list:
    return [tuple(t.clone() for t in b) for b in batches.epoch(epoch, start)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_in_memory_batches_are_the_global_batches_split_by_rank(world: int) -> None:
    data = Tensors(torch.arange(100))
    G = 8
    per_rank = [list(loader.InMemory(data, CPU, 5, G, r, world).epoch(2, 0)) for r in range(world)]
    order = loader.epoch_permutation(100, 5, 2)
    assert all(len(b) == 100 // G for b in per_rank)
    for s in range(100 // G):
        together = torch.cat([per_rank[r][s][0] for r in range(world)])
        assert torch.equal(together, order[s * G : (s + 1) * G])


def test_in_memory_resume_at_a_step_continues_the_same_order() -> None:
    data = Tensors(torch.arange(64), torch.arange(64) * 2)
    whole = list(loader.InMemory(data, CPU, 0, 8, 0, 1).epoch(1, 0))
    tail = list(loader.InMemory(data, CPU, 0, 8, 0, 1).epoch(1, 3))
    assert len(tail) == len(whole) - 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(whole[3:], tail))


@pytest.mark.slow
def test_dataset_samples_and_draws_do_not_depend_on_workers_ranks_or_restarts() -> None:
    """The same (index, augmentation draw) pairs with 0 or 2 workers, with 1 or 2 ranks, and when an
    epoch is restarted mid-way: per-sample seeds, not per-worker ones."""
    ds, G = Augmented(), 16
    one = _collect(loader.DatasetBatches(ds, CPU, 7, G, 0, 1, workers=0, prefetch=2), 1, 0)
    two_workers = _collect(loader.DatasetBatches(ds, CPU, 7, G, 0, 1, workers=2, prefetch=2), 1, 0)
    assert len(one) == len(ds) // G
    for a, b in zip(one, two_workers):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    resumed = _collect(loader.DatasetBatches(ds, CPU, 7, G, 0, 1, workers=2, prefetch=2), 1, 4)
    for a, b in zip(one[4:], resumed):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    halves = [_collect(loader.DatasetBatches(ds, CPU, 7, G, r, 2, workers=1, prefetch=2), 1, 0) for r in range(2)]
    for s, whole in enumerate(one):
        assert torch.equal(torch.cat([halves[0][s][0], halves[1][s][0]]), whole[0])
        assert torch.equal(torch.cat([halves[0][s][1], halves[1][s][1]]), whole[1])
    other_epoch = _collect(loader.DatasetBatches(ds, CPU, 7, G, 0, 1, workers=0, prefetch=2), 2, 0)
    assert not torch.equal(other_epoch[0][1], one[0][1])  # a new epoch draws anew


@pytest.mark.parametrize("n,world", [(10, 3), (5000, 4), (7, 7), (3, 4)])
def test_eval_batches_cover_every_sample_once(n: int, world: int) -> None:
    data = Tensors(torch.arange(n))
    seen = [b[0] for r in range(world) for b in loader.eval_batches(data, CPU, r, world, batch=4, workers=0)]
    together = torch.cat(seen) if seen else torch.empty(0, dtype=torch.long)
    assert torch.equal(together.sort().values, torch.arange(n))


def test_unusable_training_data_is_named() -> None:
    with pytest.raises(TypeError, match="expected ddp_slurm.Tensors or a map-style Dataset"):
        loader.make_batches(42, CPU, 0, 8, 0, 1, cfg=None)


# moved from test_data.py: the per-epoch order and its sharding
def test_epoch_permutation_is_a_pure_function_of_seed_and_epoch() -> None:
    a = loader.epoch_permutation(5000, seed=3, epoch=2)
    assert torch.equal(a, loader.epoch_permutation(5000, seed=3, epoch=2))
    assert torch.equal(a.sort().values, torch.arange(5000))  # a permutation
    others = [
        loader.epoch_permutation(5000, 3, 0),
        loader.epoch_permutation(5000, 3, 1),
        loader.epoch_permutation(5000, 3, 3),
        loader.epoch_permutation(5000, 4, 2),
    ]
    for other in others:
        assert not torch.equal(a, other)
    # seed and epoch must not collide the easy way (seed 0 epoch 1 vs seed 1 epoch 0)
    assert not torch.equal(loader.epoch_permutation(5000, 0, 1), loader.epoch_permutation(5000, 1, 0))


def test_permutation_does_not_depend_on_the_global_rng() -> None:
    torch.manual_seed(123)
    a = loader.epoch_permutation(1000, 0, 0)
    torch.manual_seed(456)
    torch.rand(10)
    assert torch.equal(a, loader.epoch_permutation(1000, 0, 0))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_samples, global_batch", [(5000, 120), (5000, 12), (1000, 996)])
def test_sharding_is_disjoint_complete_and_deterministic(num_samples: int, global_batch: int, world_size: int) -> None:
    perm = loader.epoch_permutation(num_samples, seed=0, epoch=1)
    steps = loader.steps_per_epoch(num_samples, global_batch)
    assert steps == num_samples // global_batch
    seen: list[int] = []
    for step in range(steps):
        parts = [perm[loader.rank_slice(step, global_batch, rank, world_size)] for rank in range(world_size)]
        assert all(len(p) == global_batch // world_size for p in parts)
        # the ranks together take exactly this step's global batch, in order, each its own part
        assert torch.equal(torch.cat(parts), perm[step * global_batch : (step + 1) * global_batch])
        # the same call again (another rank, a restarted job) gives the same indices
        assert all(
            torch.equal(p, perm[loader.rank_slice(step, global_batch, r, world_size)]) for r, p in enumerate(parts)
        )
        for p in parts:
            seen += p.tolist()
    assert len(seen) == len(set(seen)) == steps * global_batch  # disjoint over ranks and steps
    assert sorted(seen) == sorted(perm[: steps * global_batch].tolist())  # complete over full global batches


def test_global_batch_is_the_same_whatever_the_world_size() -> None:
    """Same global batch and seed: every world size trains on the same samples at each step."""
    perm = loader.epoch_permutation(5000, 0, 0)
    for step in (0, 7, 40):
        batches = [torch.cat([perm[loader.rank_slice(step, 120, r, ws)] for r in range(ws)]) for ws in (1, 2, 3, 4)]
        assert all(torch.equal(batches[0], b) for b in batches[1:])


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
@pytest.mark.parametrize("num_samples", [5000, 10000, 6, 1])
def test_eval_shard_covers_every_image_once(num_samples: int, world_size: int) -> None:
    shards = [loader.eval_shard(num_samples, rank, world_size) for rank in range(world_size)]
    assert shards[0][0] == 0 and shards[-1][1] == num_samples
    for (_, stop), (start, _) in zip(shards, shards[1:]):
        assert stop == start  # contiguous: no gap, no overlap
    sizes = [stop - start for start, stop in shards]
    assert sum(sizes) == num_samples and max(sizes) - min(sizes) <= 1  # no padding, balanced
