"""Stages of ``benchmarks/gpu_check.sh`` on one CUDA GPU, each a test of its own so that the script runs
each under its own time limit: fsdp saves, stops and resumes bit-identical; accumulation with clipping
trains under ddp and fsdp; ``checkpoint.async=false`` saves, stops and resumes bit-identical; a NaN loss
under ``DDP_SLURM_SYNC_DEBUG=error`` ends with the one line that names its step, not a traceback.

Marked ``gpu`` and skipped without CUDA, as tests/test_gpu_path.py (CI machines have none). The 2-GPU
fsdp check is tests/test_fsdp.py's 2-rank stop-and-resume test, which picks NCCL and one GPU per rank by
itself where CUDA is visible; gpu_check.sh runs it when the machine has 2 GPUs.
"""

from __future__ import annotations

import math
import re
from typing import Any

import helpers
import pytest
import torch
from conftest import Launcher, base_env
from test_gpu_path import _rows, _train_until

from ddp_slurm.train import checkpoint

pytestmark = helpers.gpu_only("benchmarks/gpu_check.sh")

RESUMABLE = ["model.name=cnn", "train.epochs=2", "train.deterministic=true", "train.log_every_steps=5"]

# The mnist task whose loss turns NaN at its 8th step (counted in Python: no host sync), past the
# sync-debug watch's warm-up (syncdebug.WARMUP_STEPS = 3).
NAN_TASK = """
from ddp_slurm.tasks.mnist.task import MNIST


class NanAt8(MNIST):
    steps = 0

    def training_step(self, model, batch):
        self.steps += 1
        loss = super().training_step(model, batch)
        return loss * float("nan") if self.steps == 8 else loss
"""


def assert_same_tensors(got: Any, want: Any, where: str = "") -> None:
    """Every tensor of ``want`` equal, bit for bit, to ``got``'s at the same place (nested dicts/lists)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            assert_same_tensors(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_tensors(a, b, f"{where}/{i}")


def _stop_and_resume_is_bit_identical(launcher: Launcher, name: str, overrides: list[str]) -> None:
    _train_until(launcher, f"{name}-whole", overrides, None)
    _train_until(launcher, f"{name}-resumed", overrides, 30)
    whole = checkpoint.load_latest(launcher.cwd / "runs" / f"{name}-whole")
    resumed = checkpoint.load_latest(launcher.cwd / "runs" / f"{name}-resumed")
    assert whole is not None and resumed is not None
    assert whole["finished"] and resumed["finished"] and whole["step"] == resumed["step"]
    assert_same_tensors(resumed["model"], whole["model"], "model")
    assert_same_tensors(resumed["optimizer"]["state"], whole["optimizer"]["state"], "optimizer")


def test_fsdp_saves_stops_and_resumes_bit_identical(launcher: Launcher) -> None:
    """dist.strategy=fsdp on one GPU: sharded checkpoints (DCP, asynchronous), SIGUSR2 mid-epoch, the
    relaunch ends bit-identical to the run left alone."""
    _stop_and_resume_is_bit_identical(launcher, "fsdp", [*RESUMABLE, "dist.strategy=fsdp"])
    folder = sorted((launcher.cwd / "runs" / "fsdp-resumed" / "checkpoints").glob("step-*"))[-1]
    assert (folder / "commit.pt").is_file() and (folder / ".metadata").is_file()


def test_synchronous_saves_stop_and_resume_bit_identical(launcher: Launcher) -> None:
    """checkpoint.async=false on a GPU (the state copied to host in one batch, then torch.save): SIGUSR2
    mid-epoch, the relaunch ends bit-identical to the run left alone."""
    _stop_and_resume_is_bit_identical(launcher, "sync", [*RESUMABLE, "checkpoint.async=false"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_accumulation_with_clipping_trains(launcher: Launcher, strategy: str) -> None:
    """train.accumulate=4 with train.grad_clip=1.0: the cnn learns in one epoch and every train line
    carries a finite, positive grad_norm (fsdp: clip_grad_norm_ over DTensor shards)."""
    res = launcher.run(
        launcher.cmd_train(
            "model.name=cnn",
            "train.epochs=1",
            "train.accumulate=4",
            "train.grad_clip=1.0",
            "train.log_every_steps=10",
            f"dist.strategy={strategy}",
            f"run.name=accum-{strategy}",
        ),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    rows = _rows(launcher.cwd / "runs" / f"accum-{strategy}")
    norms = [r["grad_norm"] for r in rows if r["kind"] == "train"]
    assert norms and all(math.isfinite(n) and n > 0 for n in norms), norms
    assert [r["accuracy"] for r in rows if r["kind"] == "eval"][-1] > 0.9


def test_nan_under_sync_debug_ends_with_one_line(launcher: Launcher) -> None:
    """A NaN loss at step 8 while DDP_SLURM_SYNC_DEBUG=error watches the steps: exit 1 with the one line
    'loss is nan at step N' (N >= 8: the vote reads a step's flags one step late), no traceback."""
    (launcher.cwd / "nan_task.py").write_text(NAN_TASK)
    res = launcher.run(
        launcher.cmd_train("task=nan_task.py:NanAt8", "model.name=mlp", "train.epochs=1", "run.name=nan"),
        env=base_env(DDP_SLURM_SYNC_DEBUG="error"),
        timeout=300,
    )
    assert res.returncode == 1, res.stderr[-4000:]
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    found = re.findall(r"loss is nan at step (\d+)", res.stderr)
    assert found and int(found[-1]) >= 8, res.stderr[-4000:]
