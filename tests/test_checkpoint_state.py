"""train/checkpoint/standard.py's parts (with the whole-file backend): what a checkpoint holds and how each rank
reads its part back (single process, real tensors)."""

from __future__ import annotations

import random

import helpers
import numpy as np
import pytest
import torch

from ddp_slurm import config
from ddp_slurm.tasks.mnist import models
from ddp_slurm.train import checkpoint, rng
from ddp_slurm.train.checkpoint import state
from ddp_slurm.train.checkpoint.backends import WholeFile
from ddp_slurm.train.optim import make_optimizer, make_scheduler

CPU = torch.device("cpu")
WHOLE = WholeFile()


objects = helpers.run_objects


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = models.build("mlp")
    cfg = config.Config()
    optimizer = make_optimizer(cfg.train, model.parameters(), CPU)
    scheduler = make_scheduler(cfg.train, optimizer, 100)
    return cfg, model, optimizer, scheduler


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(()).item()


def test_position_advances_and_keeps_the_best() -> None:
    pos = state.Position()
    for _ in range(3):
        pos.advance()
    assert (pos.step, pos.step_in_epoch) == (3, 3)
    pos.next_epoch()
    assert (pos.step, pos.epoch, pos.step_in_epoch) == (3, 1, 0)
    for value in (0.5, 0.7, 0.6, None):
        pos.improve(value, higher_is_better=True)
    assert pos.best == 0.7
    low = state.Position()
    for value in (0.5, 0.3, 0.4):
        low.improve(value, higher_is_better=False)
    assert low.best == 0.3


def test_every_rng_stream_comes_back(tmp_path) -> None:
    """python, numpy and torch streams survive a real checkpoint file (weights_only loading)."""
    cfg, model, optimizer, scheduler = _objects()
    rng.seed_rank(3, rank=0, step=0, device=CPU)
    _draws()
    snap = WHOLE.capture(
        objects(model, optimizer, scheduler, state.Position(step=5)), False, 1.0, {"config": cfg.to_dict()}
    )
    expected = _draws()
    path = checkpoint.save(tmp_path, snap, keep=2)
    loaded = WHOLE.read(path)
    _draws()  # move every stream on
    _, model2, optimizer2, scheduler2 = _objects(seed=1)
    pos = WHOLE.restore(path, loaded, objects(model2, optimizer2, scheduler2, seed=3))
    assert _draws() == expected
    assert pos.step == 5
    for name, t in model.state_dict().items():
        assert torch.equal(t, model2.state_dict()[name]), name


def test_each_rank_gets_its_own_stream_and_a_new_rank_a_fresh_one() -> None:
    """Saved by 2 ranks: rank 1 reads rank 1's stream back; at world size 3, rank 2 is seeded from
    (seed, rank, step), distinct from the others."""
    cfg, model, optimizer, scheduler = _objects()
    streams = []
    for rank in range(2):
        rng.seed_rank(0, rank, 0, CPU)
        streams.append(rng.rng_state(CPU))
    snap = {
        "format": checkpoint.FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "task": {},
        "step": 9,
        "epoch": 0,
        "step_in_epoch": 9,
        "finished": False,
        "elapsed_s": 0.0,
        "best": None,
        "rng": streams,
    }
    rng.set_rng_state(streams[1], CPU)
    rank1 = _draws()
    WHOLE.restore(None, snap, objects(model, optimizer, scheduler, rank=1, world_size=2))
    assert _draws() == rank1
    fresh = []
    for rank in range(3):
        WHOLE.restore(None, snap, objects(model, optimizer, scheduler, rank=rank, world_size=3))
        fresh.append(_draws())
    assert len(set(fresh)) == 3


def test_a_format_1_checkpoint_of_this_release_still_resumes(tmp_path) -> None:
    """The layout written before tasks existed (rank 0's RNG as one dict, samples_in_epoch, best_accuracy)."""
    cfg, model, optimizer, scheduler = _objects()
    old = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": 100,
        "epoch": 1,
        "samples_in_epoch": 22 * 64,
        "finished": False,
        "elapsed_s": 3.0,
        "best_accuracy": 0.91,
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        "config": cfg.to_dict(),
        "world_size": 1,
        "restart_count": 0,
        "format": 1,
    }
    old["content_sha256"] = checkpoint.content_digest(old)
    path = tmp_path / "checkpoints" / "step-100.pt"
    path.parent.mkdir()
    torch.save(old, path)
    loaded = WHOLE.read(path)  # upgraded to today's shape as it is read
    pos = WHOLE.restore(path, loaded, objects(model, optimizer, scheduler))
    assert (pos.step, pos.epoch, pos.step_in_epoch, pos.best) == (100, 1, 22, 0.91)


def test_an_unknown_format_is_refused_with_its_reason(tmp_path) -> None:
    _, model, _, _ = _objects()
    bad = {"format": 7, "model": model.state_dict(), "step": 1, "epoch": 0, "finished": False}
    bad["content_sha256"] = checkpoint.content_digest(bad)
    with pytest.raises(ValueError, match="format 7"):
        checkpoint.validate(bad)


@pytest.mark.parametrize("higher", [True, False])
def test_improve_tracks_the_best_its_step_and_the_evaluations_without_improvement(higher: bool) -> None:
    """``Position.improve``: a new best is any gain (its value and step kept); early stopping's count
    (``stale``) restarts only on a gain of more than ``min_delta``, in the task's direction."""
    sign = 1 if higher else -1
    pos = state.Position(step=4)
    seen = []
    for step, value in [(4, 0.5), (8, 0.55), (12, 0.40), (16, 0.70), (20, 0.70)]:
        pos.step = step
        seen.append((pos.improve(sign * value, higher, min_delta=0.1), pos.stale, pos.best_step, pos.evaluated))
    assert seen == [(True, 0, 4, 4), (True, 1, 8, 8), (False, 2, 8, 12), (True, 0, 16, 16), (False, 1, 16, 20)]
    assert pos.best == sign * 0.70
    pos.step = 24
    assert not pos.improve(None, higher) and pos.evaluated == 24 and pos.stale == 1  # no metric: nothing judged
