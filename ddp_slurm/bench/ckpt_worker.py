"""A small training process that checkpoints the way ``ddp_slurm.train`` does, with AsyncCheckpointer.

``python -m ddp_slurm.bench.ckpt_worker --run-dir D [options]``: trains a small MLP on synthetic
batches (deterministic per step, so a resumed run computes exactly what an uninterrupted one does)
next to ``--state-mb`` MiB of model-and-optimizer-like state, saving every ``--every`` steps; one
process, or one rank of a torchrun/gloo launch (rank 0 writes). It is the checkpoint benchmark's
subject and the harness of the checkpoint tests, and it follows the sequence the training loop uses:

- every step: ``ckpt.poll()``; a writer failure is folded into the ranks' per-step flag exchange, so
  every rank stops at the same step and rank 0 raises the one-line error (exit 1);
- after a save, the flags once more: a signal that came during the save stops at the step just saved;
- a stop signal: save the stop step unless it is the one just saved, with ``urgent=True`` (an
  older step's write still in flight is cancelled), ``ckpt.wait()``, then exit 75; the end of
  training: the final save with ``urgent=True``, ``wait()``.

It prints one JSON line per event on stdout (``ready``, ``begin``, ``handed`` (the save returned to
training; with async, its write goes on), ``durable``, ``stopped``, ...) with
``t`` from ``time.monotonic()`` (one clock for every process of the host on Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_slurm.exitcodes import EXIT_FAILURE, EXIT_OK, EXIT_STOPPED, exit_now
from ddp_slurm.train import checkpoint
from ddp_slurm.train.checkpoint.wholefile_writer import AsyncCheckpointer
from ddp_slurm.train.signals import StopFlag

TENSOR_MB = 16  # the synthetic state comes in tensors of this size, as a big model's layers do


def emit(event: str, **fields: Any) -> None:
    # One write of the whole line: under torchrun the ranks share one pipe, and a line written in one
    # piece (under PIPE_BUF) never interleaves with another rank's (print writes the newline apart).
    sys.stdout.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def synthetic_state(mib: float, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """``mib`` MiB of float32 in three equal parts, weights and Adam's two moments, in 16 MiB tensors."""
    g = torch.Generator().manual_seed(seed)
    total = int(mib * 2**20) // 4
    per_part, chunk = total // 3, TENSOR_MB * 2**20 // 4
    parts: dict[str, dict[str, torch.Tensor]] = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, part in parts.items():
        left, i = per_part, 0
        while left > 0:
            n = min(chunk, left)
            part[f"layer{i}"] = torch.rand(n, generator=g) if name == "weights" else torch.zeros(n)
            left, i = left - n, i + 1
    return parts


class Trainer:
    """The small model, its optimizer and the big synthetic state; ``state()`` and ``load()`` for checkpoints."""

    def __init__(self, width: int, batch: int, state_mb: float, seed: int, world: int, device: str = "cpu") -> None:
        """``device`` "cuda": the model, its optimizer and the big state live on the GPU (one rank), so
        a save copies them into pinned host memory, as ``ddp_slurm.train`` does on a GPU."""
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        ).to(self.device)
        self.net = nn.parallel.DistributedDataParallel(self.model) if world > 1 else self.model
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.big = {
            name: {k: t.to(self.device) for k, t in part.items()}
            for name, part in synthetic_state(state_mb, seed).items()
        }
        self.width, self.batch, self.seed, self.step = width, batch, seed, 0

    def train_step(self, rank: int) -> None:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step * 101 + rank)
        x = torch.randn(self.batch, self.width, generator=g).to(self.device)
        y = torch.randint(0, 10, (self.batch,), generator=g).to(self.device)
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step += 1
        for part in self.big.values():  # the big state changes as an optimizer's does: all of it, in turns
            if part:
                part[f"layer{self.step % len(part)}"].add_(1.0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a step's time is its device work (the timings are the host's)

    def state(self, finished: bool = False) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "big": self.big,
            "step": self.step,
            "epoch": 0,
            "samples_in_epoch": self.step * self.batch,
            "finished": finished,
        }

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        for name, part in state["big"].items():
            for key, t in part.items():
                self.big[name][key].copy_(t)
        self.step = state["step"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddp_slurm.bench.ckpt_worker", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--state-mb", type=float, default=8.0, help="MiB of synthetic model+optimizer state")
    p.add_argument("--steps", type=int, default=100, help="train this many steps in all")
    p.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--mode", choices=("async", "sync"), default="async")
    p.add_argument(
        "--writer", choices=("process", "thread"), default=None, help="async writer (default: wholefile_writer.py's)"
    )
    p.add_argument("--width", type=int, default=64, help="the small model's width (sets the step time)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step (slow steps)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives (cuda: one rank)")
    return p.parse_args(argv)


def exchange(flags: list[float], world: int) -> list[bool]:
    """Every rank's flags, MAX-reduced: all ranks act on the same step."""
    t = torch.tensor(flags)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [v > 0 for v in t.tolist()]


def run(args: argparse.Namespace, stop: StopFlag) -> int:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    tr = Trainer(args.width, args.batch, args.state_mb, args.seed, world, args.device)
    if rank == 0:
        checkpoint.remove_stale_temporaries(args.run_dir)  # left by a writer killed mid-save, as the loop does
    if world > 1:
        dist.barrier()
    found = checkpoint.latest(args.run_dir)  # every rank reads the same file
    if found is not None:
        tr.load(found[1])
        emit("resumed", step=tr.step, path=str(found[0]))
        if found[1]["finished"]:
            return EXIT_OK
    ckpt = AsyncCheckpointer(
        args.run_dir,
        args.keep,
        enabled=args.mode == "async",
        writer=args.writer,
        on_durable=lambda path, t: emit("durable", path=str(path), step=int(path.stem.split("-")[1]), t=t),
        stop_pending=lambda: stop.requested,
    )
    last_saved = tr.step

    def save(finished: bool = False, urgent: bool = False) -> None:
        nonlocal last_saved
        if rank == 0:
            emit("begin", step=tr.step, finished=finished)
            ckpt.save(tr.state(finished), urgent=urgent)
            emit("handed", step=tr.step)
        last_saved = tr.step

    emit("ready", step=tr.step, pid=os.getpid(), rank=rank)
    try:
        stopping = failed = False
        while tr.step < args.steps:
            tr.train_step(rank)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if rank == 0 and not ckpt.failed:
                ckpt.poll()  # logs (and reports) a write that became durable
            stopping, failed = exchange([float(stop.requested), float(rank == 0 and ckpt.failed)], world)
            if failed:
                break
            if tr.step % args.every == 0 and tr.step < args.steps and not stopping:
                save()
                stopping, failed = exchange([float(stop.requested), float(rank == 0 and ckpt.failed)], world)
                if failed:
                    break
            if stopping:
                break
        if failed:
            if rank == 0:
                ckpt.wait()  # raises the writer's CheckpointError
            return EXIT_FAILURE
        if stopping:
            if last_saved != tr.step:  # an older step's write still in flight is cancelled (process writer)
                save(urgent=True)
            if rank == 0:
                ckpt.wait()  # the stop step durable before any rank exits
            exchange([0.0], world)  # no rank exits 75 before the stop step is durable
            emit("stopped", step=tr.step)
            return EXIT_STOPPED
        save(finished=True, urgent=True)
        if rank == 0:
            ckpt.wait()
        exchange([0.0], world)
        emit("finished", step=tr.step)
        return EXIT_OK
    finally:
        if rank == 0 and ckpt.in_flight:  # an unexpected error above: still never leave a write half done
            ckpt.close()


def set_threads() -> None:
    """Intra-op threads: OMP_NUM_THREADS where the launcher set it (``bench checkpoint --threads``), else one."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads()
    stop = StopFlag().install()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        return run(args, stop)
    except checkpoint.CheckpointError as exc:
        print(f"ckpt_worker: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    finally:
        stop.stopping = True
        stop.close()


if __name__ == "__main__":
    code = main()
    exit_now(code)  # a finished gloo rank must not finalize (see exitcodes.exit_now)
