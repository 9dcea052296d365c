"""Host waits on a CUDA GPU (issue 37): the slow-rank clock (world size 2 and more) holds few CUDA events and
reads each only once it has completed, adding no sync to a step; an fsdp save stages its shards with one
wait for them all, not a blocking copy per tensor (a save is a boundary, so the sync-debug watch of the
loop does not see those: here they are counted under "warn"). The guard under sync-debug on a GPU:
tests/test_gpu_smoke.py.

Marked ``gpu`` and skipped without CUDA, as tests/test_gpu_path.py (CI machines have none). On CPU the same
rules are tested with stand-ins for the GPU: tests/test_slowranks.py (``FakeDevice``) and
tests/test_sharded_staging.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import helpers
import torch

from ddp_slurm.distributed import group
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train import clock

pytestmark = helpers.gpu_only("benchmarks/gpu_check.sh")


def test_the_slow_rank_clock_holds_few_events_and_reads_them_once_completed() -> None:
    """300 timed forwards under sync-debug "error" (the clock's reads of completed events wait for nothing),
    then ``take`` at once, the last forwards still queued: no error, every forward counted."""
    device = torch.device("cuda", 0)
    x = torch.randn(1024, 1024, device=device)
    timer, forward = clock.for_run(lambda model, batch: (x @ x).sum(), device, 2)
    assert timer is not None and clock.for_run(forward, device, 1)[0] is None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(300):
            forward(None, None)
            assert len(timer._events) <= clock.LIMIT
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert timer.take() > 0.0 and not timer._events


def test_an_fsdp_save_stages_its_shards_with_one_wait(tmp_path: Path) -> None:
    """80 parameter tensors sharded on one GPU, saved asynchronously under sync-debug "warn": the staging
    waits for the device once, not once per tensor (a blocking copy each)."""
    from ddp_slurm.train import fsdp
    from ddp_slurm.train.checkpoint import sharded_writer

    with group.distributed(DistEnv.from_environ({}), "nccl") as (device, _):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(40)]).to(device)
        model = fsdp.shard(model, [], device, "fp32")
        paths = RunPaths(tmp_path / "r")
        paths.root.mkdir()
        ckpt = sharded_writer.ShardedCheckpointer(paths, True)
        state = {"model": model.state_dict()}
        ckpt.save((state, {"step": 1}))  # the first save makes the pinned buffers
        ckpt.wait()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert ckpt.save((state, {"step": 2})) is None  # in the background
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ckpt.close()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 2, [str(w.message) for w in syncs][:5]
