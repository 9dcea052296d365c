"""The first stages of ``benchmarks/gpu_smoke.sh`` on one CUDA GPU: what failed on a GPU while the CPU suite
passed (issue 37), each a test of its own so that the script runs each under its own time limit.

- fsdp with ``train.precision=bf16`` and a model with BatchNorm (the cnn) trains: bf16's mixed-precision
  policy must leave BatchNorm's parameters in fp32 (defect 1);
- a guard rollback under ``DDP_SLURM_SYNC_DEBUG=error`` goes on training, with no sync-debug traceback
  (defect 3: the rollback's restore and the verdict read the device while the watch was on);
- at world size 1 every CUDA event the runtime records is read (defect 4: the slow-rank clock recorded two
  per step and never read them: unbounded growth; at 2 ranks and more: tests/test_gpu_syncs.py);
- the loop's fsdp saves while ``DDP_SLURM_SYNC_DEBUG=error`` watches the steps between them (a save's own
  staging waits once for all shards: tests/test_gpu_syncs.py counts them);
- activation checkpointing never synchronises in a steady step (fp16 and the guard: tests/test_gpu_path.py).

Marked ``gpu`` and skipped without CUDA, as tests/test_gpu_stages.py (CI machines have none); whether each
stage exists and what it names is checked on CPU by tests/test_gpu_check.py.
"""

from __future__ import annotations

import json
import re
import sys

import helpers
import pytest
import torch
from conftest import Launcher, base_env
from test_gpu_path import _rows, _watched
from test_gpu_stages import NAN_TASK

pytestmark = helpers.gpu_only("benchmarks/gpu_smoke.sh")

SHORT = ["model.name=cnn", "train.max_steps=40", "train.log_every_steps=10"]


def test_fsdp_bf16_with_batchnorm_trains(launcher: Launcher) -> None:
    """dist.strategy=fsdp, train.precision=bf16, the cnn (BatchNorm after each convolution): 40 steps with a
    sharded save, every train line's loss finite."""
    if torch.cuda.get_device_capability(0) < (8, 0):
        pytest.skip("bf16 needs compute capability 8.0 or newer (train.precision refuses it below)")
    res = launcher.run(
        launcher.cmd_train(
            *SHORT, "dist.strategy=fsdp", "train.precision=bf16", "checkpoint.every_steps=20", "run.name=fsdp-bf16"
        ),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    losses = [r["loss"] for r in _rows(launcher.cwd / "runs" / "fsdp-bf16") if r["kind"] == "train"]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses), losses


def test_guard_rollback_under_sync_debug_goes_on(launcher: Launcher) -> None:
    """A NaN loss at step 8 with the guard on, while DDP_SLURM_SYNC_DEBUG=error watches the steps: rolled
    back, replayed, judged, and the run ends (exit 0) without a traceback."""
    (launcher.cwd / "nan_task.py").write_text(NAN_TASK)
    res = launcher.run(
        launcher.cmd_train("task=nan_task.py:NanAt8", *SHORT, "guard.rollbacks=2", "run.name=guard-sync-debug"),
        env=base_env(DDP_SLURM_SYNC_DEBUG="error"),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    assert re.search(r"rolled back to step \d+", res.stderr), res.stderr[-4000:]
    assert _watched(res.stderr) > 0, res.stderr[-2000:]


# torch.cuda.Event counted: every event recorded, and each one read (synchronize, query, elapsed_time, a
# stream's wait).
EVENTS = """
import json, sys
import torch
import ddp_slurm
from ddp_slurm.tasks.mnist import MNIST

recorded, read = set(), set()


class Counted(torch.cuda.Event):
    def record(self, stream=None):
        recorded.add(id(self))
        return super().record(stream)

    def synchronize(self):
        read.add(id(self))
        return super().synchronize()

    def query(self):
        read.add(id(self))
        return super().query()

    def wait(self, stream=None):  # a stream waits for it: consumed on the device
        read.add(id(self))
        return super().wait(stream)

    def elapsed_time(self, end):
        read.update((id(self), id(end)))
        return super().elapsed_time(end)


torch.cuda.Event = Counted
code = ddp_slurm.run(MNIST, sys.argv[1:])
print(json.dumps({"code": code, "recorded": len(recorded), "unread": len(recorded - read)}))
"""


def test_world1_reads_every_cuda_event_it_records(launcher: Launcher) -> None:
    """One rank, 200 steps: the events the runtime records (the vote's, the clock's if it times) are all
    read, but for a few in flight at the end; two per step left unread grow without bound."""
    (launcher.cwd / "events.py").write_text(EVENTS)
    overrides = ["model.name=mlp", "train.max_steps=200", "train.log_every_steps=20", "run.name=events"]
    res = launcher.run([sys.executable, "events.py", *overrides], timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert counts["code"] == 0, res.stderr[-4000:]
    assert counts["unread"] <= 4, counts


def test_fsdp_saves_under_sync_debug(launcher: Launcher) -> None:
    """dist.strategy=fsdp with a sharded, asynchronous save every 10 steps while DDP_SLURM_SYNC_DEBUG=error
    watches the steady steps: the staging of each save never syncs inside a watched step; every save commits."""
    res = launcher.run(
        launcher.cmd_train(*SHORT, "dist.strategy=fsdp", "checkpoint.every_steps=10", "run.name=fsdp-sync-debug"),
        env=base_env(DDP_SLURM_SYNC_DEBUG="error"),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert _watched(res.stderr) >= 20, res.stderr[-2000:]
    run = launcher.cwd / "runs" / "fsdp-sync-debug" / "checkpoints"
    assert sorted(p.name for p in run.glob("step-*")), list(run.iterdir())


def test_activation_checkpoint_never_synchronises(launcher: Launcher) -> None:
    """train.activation_checkpoint=true (the forward recomputed in backward) under DDP_SLURM_SYNC_DEBUG=error:
    no host sync in any steady step, saves and log lines between them."""
    res = launcher.run(
        launcher.cmd_train(
            "model.name=cnn",
            "train.max_steps=60",
            "train.log_every_steps=10",
            "checkpoint.every_steps=25",
            "train.activation_checkpoint=true",
            "run.name=ac-nosync",
        ),
        env=base_env(DDP_SLURM_SYNC_DEBUG="error"),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert _watched(res.stderr) >= 50, res.stderr[-2000:]
