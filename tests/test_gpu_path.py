"""The GPU path on a CUDA GPU: no host sync in the steady-state step nor in the stop vote (NCCL), nor in
the real loop between its boundaries (eager and with train.cuda_graphs), interrupt-and-resume
bit-identical with train.deterministic=true (eager and graphed), train.cuda_graphs on the Dataset path
and its one line for a step that needs the host, the error path's abort of an NCCL group, and NCCL's
refusal of two ranks on one GPU turned into one line.

Marked ``gpu`` like tests/test_gpu.py, and skipped the same way without CUDA (CI machines have none);
``benchmarks/gpu_check.sh`` runs both files and fails if anything skips. Checks that need two GPUs are
stages of gpu_check.sh, so that nothing here skips on a one-GPU machine.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import helpers
import pytest
import torch
import torch.nn.functional as F
from conftest import Launcher, base_env
from tasks_helpers import addition_tiny

from ddp_slurm import config
from ddp_slurm.distributed import group
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.exitcodes import EXIT_STOPPED
from ddp_slurm.tasks.mnist import data, models
from ddp_slurm.train import checkpoint
from ddp_slurm.train.optim import make_optimizer
from ddp_slurm.train.signals import StopFlag
from ddp_slurm.train.vote import StopVote

pytestmark = helpers.gpu_only("benchmarks/gpu_check.sh")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_stop_vote_and_steps_never_synchronise_the_host() -> None:
    """Steady-state steps (data resident on the GPU, the package's fused optimizer) with the stop vote,
    through NCCL (a 1-rank group; the vote is told 2 ranks so that it all-reduces, which over one rank
    is the identity), under set_sync_debug_mode("error"): any stream or device synchronisation raises.
    A signal is still agreed exactly one step late, and a non-finite loss is named with its step."""
    device = torch.device("cuda", 0)
    with group.distributed(DistEnv.from_environ({}), "nccl") as (dev, backend):
        assert (dev, backend) == (device, "nccl")
        train = data.load_sample(train=True)
        images, labels = train.images.to(device), train.labels.to(device)
        cfg = config.load(overrides=["model.name=mlp"]).train
        torch.manual_seed(0)
        model = models.build("mlp").to(device)
        opt = make_optimizer(cfg, model.parameters(), device)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0)).to(device)

        def step(i: int) -> torch.Tensor:
            batch = order[(i % 70) * 64 : (i % 70 + 1) * 64]
            loss = F.cross_entropy(model(data.normalize(images.index_select(0, batch))), labels.index_select(0, batch))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.detach()

        stop = StopFlag()
        votes = StopVote(stop, 2, device)
        for i in range(1, 4):  # warm-up: allocations, NCCL's first collective, the pinned buffers
            votes.exchange(step(i), i)
        torch.cuda.synchronize()
        agreed = {}
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(4, 70):
                if i == 40:
                    stop.requeue_requested = True  # arrives during step 40
                agreed[i] = votes.exchange(step(i), i)
            # a NaN still in the watched steps: named with its step, not a sync-debug error (the read of
            # the failed loss may wait)
            votes.exchange(torch.full((), float("nan"), device=device), 70)
            flagged = votes.exchange(step(71), 71)
            assert torch.cuda.get_sync_debug_mode() == 2  # "error" is back on after the failure's read
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(agreed[i] == (False, False, False) for i in range(4, 41)), agreed
        assert all(agreed[i] == (True, False, False) for i in range(41, 70)), agreed
        assert flagged == (True, False, True)
        assert votes.bad == "loss is nan at step 70"


def _watched(stderr: str) -> int:
    """Steady steps the loop ran under DDP_SLURM_SYNC_DEBUG (its closing log line), 0 without the line."""
    import re

    found = re.search(r"(\d+) steady steps ran without a host sync", stderr)
    return int(found.group(1)) if found else 0


@pytest.mark.parametrize(
    "graphs, precision, guard",
    [(False, "fp32", 0), (True, "fp32", 0), (False, "fp16", 0), (False, "fp32", 3)],
    ids=["eager", "cuda_graphs", "fp16", "guard"],
)
def test_the_real_loop_never_synchronises_between_boundaries(
    launcher: Launcher, graphs: bool, precision: str, guard: int
) -> None:
    """``python -m ddp_slurm.train`` itself (vote, loss window, progress, watchdog, checkpoints every 25
    steps, two epochs with evaluation) under set_sync_debug_mode("error") from its 3rd step on, switched
    off only around log lines, saves and evaluations (DDP_SLURM_SYNC_DEBUG, train/hooks/syncdebug.py): any
    synchronising call in a steady step raises and the run fails. Eagerly, with train.cuda_graphs, and with
    train.precision=fp16 (the gradient scaler decides its skips on the device with the fused optimizer), and
    with the guard on (guard.rollbacks=3: its loss and gradient trace stay on the device, the mean loss rides
    the stop vote)."""
    res = launcher.run(
        launcher.cmd_train(
            "model.name=cnn",
            "train.epochs=2",
            "train.log_every_steps=10",
            "checkpoint.every_steps=25",
            f"train.cuda_graphs={str(graphs).lower()}",
            f"train.precision={precision}",
            f"guard.rollbacks={guard}",
            f"run.name=nosync-{graphs}-{precision}-{guard}",
        ),
        env=base_env(DDP_SLURM_SYNC_DEBUG="error"),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert _watched(res.stderr) >= 150, res.stderr[-2000:]  # 156 steps, 3 of warm-up


def _train_until(launcher: Launcher, name: str, overrides: list[str], stop_after: int | None) -> None:
    """Train ``name``; with ``stop_after``, SIGUSR2 once a ``train`` row at or past that step is written, check the
    clean stop (exit 75), and launch again to the end."""
    cmd = launcher.cmd_train(*overrides, f"run.name={name}")
    if stop_after is not None:
        run_dir = launcher.cwd / "runs" / name
        proc = launcher.popen(cmd)
        deadline = time.monotonic() + 300
        while not any(r["kind"] == "train" and r["step"] >= stop_after for r in _rows_if_any(run_dir)):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no training within 300 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGUSR2)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == EXIT_STOPPED, out
    res = launcher.run(cmd, timeout=600)
    assert res.returncode == 0, res.stderr


def _rows_if_any(run_dir: Path) -> list[dict]:
    try:
        return _rows(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):  # not there yet, or a line being written
        return []


@pytest.mark.parametrize(
    "graphs, precision", [(False, "fp32"), (True, "fp32"), (False, "fp16")], ids=["eager", "cuda_graphs", "fp16"]
)
def test_deterministic_interrupt_and_resume_is_bit_identical(launcher: Launcher, graphs: bool, precision: str) -> None:
    """cnn (cuDNN convolutions), train.deterministic=true: stopped by SIGUSR2 mid-epoch and resumed, the
    final weights and optimizer state equal those of an uninterrupted run bit for bit; with
    train.cuda_graphs too (the resumed launch captures its graph again from the restored state), and with
    train.precision=fp16 (the gradient scaler's state comes back from the checkpoint)."""
    overrides = [
        "model.name=cnn",
        "train.epochs=2",
        "train.deterministic=true",
        "train.log_every_steps=5",
        f"train.cuda_graphs={str(graphs).lower()}",
        f"train.precision={precision}",
    ]
    name = f"{graphs}-{precision}"
    _train_until(launcher, f"whole-{name}", overrides, None)
    _train_until(launcher, f"resumed-{name}", overrides, 30)
    whole = checkpoint.load_latest(launcher.cwd / "runs" / f"whole-{name}")
    resumed = checkpoint.load_latest(launcher.cwd / "runs" / f"resumed-{name}")
    assert whole["finished"] and resumed["finished"] and whole["step"] == resumed["step"]
    assert whole["scaler"] == resumed["scaler"] and (whole["scaler"] is not None) == (precision == "fp16")
    for key, tensor in whole["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key
    for index, state in whole["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, resumed["optimizer"]["state"][index][key]), (index, key)


def test_error_path_aborts_the_nccl_group() -> None:
    """The body raises after a collective: the group is aborted (not destroyed), promptly, and is gone."""
    import torch.distributed as dist

    start = time.monotonic()
    with pytest.raises(KeyError), group.distributed(DistEnv.from_environ({}), "nccl"):
        value = torch.ones(1, device="cuda")
        dist.all_reduce(value)
        raise KeyError("boom")
    assert not dist.is_initialized() and time.monotonic() - start < 60


def test_two_ranks_on_one_gpu_end_with_one_line(launcher: Launcher) -> None:
    """Two ranks that see one GPU each, the same one (CUDA_VISIBLE_DEVICES=0 for both: what a missing
    --gpus-per-task looks like under per-task cgroups): NCCL refuses, and the log says which ranks share
    a GPU and what to ask Slurm for, not "rendezvous failed"."""
    res = launcher.run(
        launcher.cmd_torchrun(2, "dist.backend=nccl", "model.name=mlp", "train.max_steps=5", "run.name=dup"),
        env=base_env(CUDA_VISIBLE_DEVICES="0"),
        timeout=300,
    )
    assert res.returncode != 0, res.stderr
    assert "share one GPU" in res.stderr and "--gpus-per-task=1" in res.stderr, res.stderr[-4000:]


def test_cuda_graphs_learn_on_the_dataset_path_with_dropout(launcher: Launcher) -> None:
    """The addition example (a Dataset through 2 workers, copied into the graph's input buffers; dropout,
    whose random numbers the graph draws anew at each replay) learns with train.cuda_graphs=true."""
    res = launcher.run(
        launcher.cmd_train(*addition_tiny(epochs=2), "train.cuda_graphs=true", "run.name=add-graphs"), timeout=300
    )
    assert res.returncode == 0, res.stderr[-4000:]
    losses = [r["loss"] for r in _rows(launcher.cwd / "runs" / "add-graphs") if r["kind"] == "train"]
    assert len(losses) >= 10 and losses[-1] < 0.8 * losses[0], losses


SYNCING_TASK = """
import torch.nn.functional as F

from ddp_slurm.tasks.mnist import MNIST, data


class Syncing(MNIST):
    def training_step(self, model, batch):
        images, labels = batch
        loss = F.cross_entropy(model(data.normalize(images)), labels)
        if loss.item() > 100:  # the host reads the loss in the middle of the step
            loss = loss * 0
        return loss
"""


def test_a_step_that_needs_the_host_is_told_what_broke(launcher: Launcher) -> None:
    """A training_step that reads a value on the host cannot be captured: one error line naming the task's
    line and what to do, no traceback, exit 1."""
    path = launcher.cwd / "syncing.py"
    path.write_text(SYNCING_TASK)
    res = launcher.run(
        launcher.cmd_train(f"task={path}:Syncing", "model.name=mlp", "train.cuda_graphs=true", "run.name=sync"),
        timeout=300,
    )
    assert res.returncode == 1, res.stderr[-4000:]
    lines = [line for line in res.stderr.splitlines() if "cannot be captured as a CUDA graph" in line]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-4000:]
    assert f"{path}:" in lines[0] and "loss.item()" in lines[0] and "train.cuda_graphs=false" in lines[0], lines
