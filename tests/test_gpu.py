"""On a CUDA GPU: NCCL at world size 1, training with the data resident on the GPU, bf16 autocast.

Marked ``gpu``; ``benchmarks/gpu_check.sh`` runs them (``pytest -m gpu``). Without CUDA they skip with
the reason, in CI too: CI machines never have a GPU, and this is the one prerequisite a CI run lacks
by design (everything else in the suite fails instead of skipping there).
"""

from __future__ import annotations

import json
from pathlib import Path

import helpers
import pytest
import torch
from conftest import Launcher

from ddp_slurm import config
from ddp_slurm.tasks.mnist import data, models
from ddp_slurm.train import loader
from ddp_slurm.train.optim import make_optimizer, make_scheduler
from ddp_slurm.train.step import autocast

pytestmark = helpers.gpu_only("benchmarks/gpu_check.sh")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_nccl_at_world_size_1_through_torchrun(launcher: Launcher) -> None:
    """torchrun, one rank, dist.backend=nccl: the process group forms on the GPU and the run finishes."""
    res = launcher.run(
        launcher.cmd_torchrun(
            1, "dist.backend=nccl", "model.name=mlp", "train.epochs=1", "train.max_steps=20", "run.name=nccl1"
        ),
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    assert "backend nccl" in res.stderr and "device cuda" in res.stderr, res.stderr
    evals = [r for r in _rows(launcher.cwd / "runs" / "nccl1") if r["kind"] == "eval"]
    assert evals and evals[-1]["test_samples"] == 5000 and evals[-1]["accuracy"] > 0.5, evals


def test_step_on_gpu_resident_data_never_waits_for_the_device() -> None:
    """make_step on uint8 data held on the GPU learns, and its steps contain no host synchronisation."""
    device = torch.device("cuda")
    train, test = data.load_sample(train=True).to(device), data.load_sample(train=False).to(device)
    cfg = config.load().train
    torch.manual_seed(0)
    model = models.build("cnn").to(device)
    opt = make_optimizer(cfg, model.parameters(), device)
    assert opt.defaults.get("fused"), "CUDA has fused optimizer kernels: the step should use them"
    step = helpers.mnist_step(model, opt, make_scheduler(cfg, opt, 2 * 39), train)
    assert train.images.device.type == "cuda" and train.images.dtype == torch.uint8
    perms = [loader.epoch_permutation(len(train), 0, epoch).to(device) for epoch in range(2)]  # copies synchronise
    losses = [step(perms[0][loader.rank_slice(0, 128, 0, 1)])]  # the first step may synchronise while it sets up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call in the steps below raises
    try:
        for epoch, perm in enumerate(perms):
            losses += [step(perm[loader.rank_slice(i, 128, 0, 1)]) for i in range(1 if epoch == 0 else 0, 39)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert losses[-1].device.type == "cuda"
    values = torch.stack(losses).tolist()
    assert values[-1] < 0.5 * values[0], values
    accuracy, images, _ = helpers.mnist_evaluate(model, test, rank=0, world_size=1)
    assert images == 5000 and accuracy > 0.9, accuracy


def test_bf16_autocast_trains(launcher: Launcher) -> None:
    """train.precision=bf16: the forward runs in bf16 and the cnn still learns (a real run on the GPU); below
    compute capability 8.0 the precision check refuses it with one line instead."""
    from ddp_slurm.config import ConfigError
    from ddp_slurm.train.precision import check_precision

    if torch.cuda.get_device_capability(0) < (8, 0):
        with pytest.raises(ConfigError, match="compute capability 8.0 or newer"):
            check_precision("bf16", torch.device("cuda", 0))
        return
    check_precision("bf16", torch.device("cuda", 0))
    model = models.build("cnn").cuda()
    with autocast(torch.device("cuda"), "bf16"):
        assert model(torch.randn(4, 1, 28, 28, device="cuda")).dtype == torch.bfloat16
    res = launcher.run(launcher.cmd_train("train.precision=bf16", "train.epochs=2", "run.name=bf16"), timeout=600)
    assert res.returncode == 0, res.stderr
    evals = [r for r in _rows(launcher.cwd / "runs" / "bf16") if r["kind"] == "eval"]
    assert len(evals) == 2 and evals[-1]["accuracy"] > 0.9, evals
