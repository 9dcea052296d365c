"""train/vote.py at world size 1: nothing to agree on, so a step posts one copy of its loss to the host and
nothing else (issue 37: per-step work the bare loop does not do), while a stop and a non-finite loss are
still noticed one step late (tests/test_step.py runs the vote's flag logic at both world sizes)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddp_slurm.train.signals import StopFlag
from ddp_slurm.train.vote import StopVote


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_one_rank_posts_one_copy_per_step_and_reads_nothing_from_the_device() -> None:
    votes = StopVote(StopFlag(), 1, torch.device("cpu"), failed=lambda: False)
    losses = [torch.tensor(0.5 + i) for i in range(12)]
    votes.exchange(losses[0], 1)
    votes.exchange(losses[1], 2)  # both slots' host buffers made
    with _Ops() as seen:
        for step in range(3, 13):
            assert votes.exchange(losses[step - 1], step) == (False, False, False)
    assert seen.ops == Counter({"aten.copy_.default": 10}), seen.ops  # no item(), no flags tensor, no collective
    # one step late: step 12's loss is read at the next exchange (the deque keeps the last 4)
    assert list(votes.losses) == [(8, 7.5), (9, 8.5), (10, 9.5), (11, 10.5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_one_rank_reads_the_loss_exactly_in_its_dtype(dtype: torch.dtype) -> None:
    votes = StopVote(StopFlag(), 1, torch.device("cpu"))
    loss = torch.tensor(1 / 3, dtype=dtype)
    votes.exchange(loss, 1)
    votes.exchange(None, 2)  # a skipped step (the guard's): nothing posted, nothing read
    votes.settle()
    assert list(votes.losses) == [(1, loss.item())]


def test_one_rank_still_names_a_non_finite_loss_and_a_stop_one_step_late() -> None:
    stop = StopFlag()
    votes = StopVote(stop, 1, torch.device("cpu"))
    votes.exchange(torch.tensor(0.5), 1)
    stop.terminate_requested = True
    assert votes.exchange(torch.tensor(float("inf")), 2) == (False, False, False)
    assert votes.exchange(torch.tensor(0.5), 3) == (False, True, True)
    assert votes.bad == "loss is inf at step 2" and votes.bad_step == 2
