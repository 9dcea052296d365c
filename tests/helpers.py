"""Test helpers shared by several test files: the MNIST task's step and evaluation driven directly."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from conftest import base_env

from ddp_slurm.distributed.groups import Groups
from ddp_slurm.tasks.mnist.data import Split
from ddp_slurm.tasks.mnist.task import MNIST, MNISTConfig
from ddp_slurm.train import checkpoint, loader, step
from ddp_slurm.train.checkpoint.state import Position
from ddp_slurm.train.task import Tensors

# How a survivor says it found a lost rank, after "no heartbeat for N s; ": the stall check saw the rank
# silent before the backend's timeout, or this rank's collective failed. Which comes first is a race
# (the collective's error on a killed peer's socket against the stall check's poll): both are right.
FOUND_BY_STALL = r"this rank waited \d+ s at step \d+ \(found before the backend's timeout\)"
FOUND_BY_COLLECTIVE = r"this rank's collective failed with: "
LOST_FOUND = rf"({FOUND_BY_STALL}|{FOUND_BY_COLLECTIVE}\S)"


def checkpoint_files(run_dir: Path) -> dict[str, tuple[int, int, str]]:
    """name -> (step, bytes, sha256) of every checkpoint file of a run that may still be training: a
    file pruned between the listing and the read is left out (it was not there to lose)."""
    found = {}
    for at, path in checkpoint.list_checkpoints(run_dir):
        try:
            found[path.name] = (at, path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
        except FileNotFoundError:
            continue
    return found


TASK = MNIST(MNISTConfig(), ctx=None)  # training_step and eval_step read neither config nor context


def mnist_step(
    model, optimizer, scheduler, split: Split, precision: str = "fp32"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``step(indices) -> loss``: the runtime's step on the MNIST task's loss, batches gathered from ``split``."""
    device = split.images.device
    run = step.make_step(model, optimizer, scheduler, TASK.training_step, device, precision)

    def by_index(indices: torch.Tensor) -> torch.Tensor:
        indices = indices.to(device)
        return run((split.images.index_select(0, indices), split.labels.index_select(0, indices)))

    return by_index


def mnist_evaluate(model, split: Split, rank: int, world_size: int, precision: str = "fp32", batch: int = 256):
    """(accuracy, samples, loss) of the runtime's exact sharded evaluation of the MNIST task."""
    device = split.images.device
    batches = loader.eval_batches(Tensors(split.images, split.labels), device, rank, world_size, batch, 0)
    values, count = step.evaluate(model, batches, TASK.eval_step, device, world_size, precision)
    return values["accuracy"], count, values["loss"]


class Injecting(MNIST):
    """The MNIST task with faults injected at this launch's N-th training step (a test harness, not a product
    hook): ``STOP_AT`` sends the process a real SIGUSR2, ``CRASH_AT`` raises on rank ``CRASH_RANK`` (default
    0; RANK unset counts as 0). Only training-mode calls count (DDP's warm-up runs no task code)."""

    calls = 0

    def training_step(self, model, batch):
        import os
        import signal

        inner = getattr(model, "module", model)
        if inner.training:
            type(self).calls += 1
            if type(self).calls == int(os.environ.get("STOP_AT", "0")):
                os.kill(os.getpid(), signal.SIGUSR2)
            rank_matches = os.environ.get("RANK", "0") == os.environ.get("CRASH_RANK", "0")
            if type(self).calls == int(os.environ.get("CRASH_AT", "0")) and rank_matches:
                raise ValueError(f"injected failure on rank {os.environ.get('RANK', '0')}")
        return super().training_step(model, batch)


INJECTING_HARNESS = """
import sys
import helpers
from ddp_slurm.train import cli
sys.exit(cli.run(sys.argv[1:], task=helpers.Injecting))
"""


def requeue_calls(calls) -> list[str]:
    """The ``scontrol requeue`` calls a recording stub saw (the allocation check's ``show job`` and
    ``write batch_script`` calls are not requeues)."""
    return [line for line in calls.read_text().splitlines() if line.startswith("requeue")] if calls.exists() else []


def run_objects(
    model: Any,
    optimizer: Any,
    scheduler: Any,
    pos: Position | None = None,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    **extra: Any,
) -> SimpleNamespace:
    """The run's objects as a checkpoint backend sees them (``backends.Objects``), for the MNIST task on
    the CPU, with torch's default group for every collective; ``extra``: more members (a scaler)."""
    return SimpleNamespace(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        task=TASK,
        pos=pos or Position(),
        device=torch.device("cpu"),
        rank=rank,
        world_size=world_size,
        seed=seed,
        groups=Groups(),
        **extra,
    )


def two_ranks(script: Path, tmp_path: Path, *extra: str, timeout: float = 300) -> tuple[Any, Any]:
    """Run ``script RANK STORE OUT [EXTRA ...]`` as ranks 0 and 1 at once (they meet through a file store
    under ``tmp_path``); each must exit 0. Returns what each wrote to its OUT file as JSON."""
    out = [tmp_path / f"out{rank}.json" for rank in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path / "store"), str(out[rank]), *extra],
            env=base_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for p in procs:
        output, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, output
    r0, r1 = (json.loads(path.read_text()) for path in out)
    return r0, r1


def resume(run_dir: Path, *args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``ddp-slurm resume RUN_DIR ARGS...`` from the folder holding ``runs/`` (its output is captured)."""
    cmd = [sys.executable, "-m", "ddp_slurm.resume", str(run_dir), *map(str, args)]
    return subprocess.run(
        cmd, cwd=run_dir.parent.parent, env=env or base_env(), capture_output=True, text=True, timeout=600
    )


def gpu_only(script: str) -> list:
    """The ``pytestmark`` of a file of GPU tests: marked ``gpu``, skipped without CUDA, naming the script that
    runs them on a GPU (``benchmarks/gpu_check.sh``, ``benchmarks/gpu_smoke.sh``)."""
    import pytest
    import torch

    reason = f"needs a CUDA GPU (torch.cuda.is_available() is false); run {script} on one"
    return [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)]


def flip_byte(path: Path, at: int) -> None:
    """One byte of ``path`` flipped at ``at``, its size and mtime kept: only the bytes tell."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
