"""What fsdp's asynchronous saves stage (ddp_slurm/train/checkpoint/sharded_writer.py): shards copied into
pinned host memory with non-blocking copies on a GPU (one wait for all, not one per tensor), plain copies on
CPU; and whether the copies fit, judged per rank against its share of its node's memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import staging

from ddp_slurm.train.checkpoint import sharded_writer
from ddp_slurm.train.checkpoint.wholefile_writer import MAX_SHARE_OF_AVAILABLE

GIB = 2**30


def test_a_cuda_run_stages_with_non_blocking_copies_into_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stager a run makes where CUDA is in use. There is no GPU here: ``torch.cuda``'s two answers are
    replaced so that the writer believes one is (a stand-in for a GPU), and DCP's stager records the options
    it is given instead of pinning memory."""
    made: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(staging, "DefaultStager", lambda options: made.append(options) or options)
    writer = object.__new__(sharded_writer.ShardedCheckpointer)  # _stage reads only its stager
    writer._stager = None
    options = writer._stage()
    assert made == [options] and writer._stage() is options  # one stager for the run
    assert options.use_non_blocking_copy, "a blocking copy per tensor on the training thread"
    assert options.use_pinned_memory and not options.use_async_staging and not options.use_shared_memory


def test_a_cpu_run_stages_with_plain_copies_that_dcp_accepts() -> None:
    options = sharded_writer.staging_options("cpu")
    assert not (options.use_non_blocking_copy or options.use_pinned_memory or options.use_async_staging)
    stager = staging.DefaultStager(options)  # refuses non-blocking copies or pinning without an accelerator
    try:
        shard = torch.arange(6.0)
        staged = stager.stage({"w": shard})
        assert torch.equal(staged["w"], shard) and staged["w"].data_ptr() != shard.data_ptr()
    finally:
        stager.close()
    assert sharded_writer.staging_options("cuda").use_non_blocking_copy


def test_host_copies_are_judged_against_the_ranks_share_of_the_node() -> None:
    """8 ranks on a node, each staging 3 GiB against 16 GiB available: each passed a check against the whole
    host (3 <= 8), and together they would pin 24 GiB, 1.5 times all of it. Each rank gets 2 GiB."""
    need, avail = 3 * GIB, 16 * GIB
    assert need <= MAX_SHARE_OF_AVAILABLE * avail  # what every rank checked before
    assert not sharded_writer.fits(need, avail, 8)
    assert sharded_writer.fits(GIB, avail, 8) and not sharded_writer.fits(GIB + 1, avail, 8)
    assert sharded_writer.fits(need, avail, 1) and sharded_writer.fits(need, None, 8)
