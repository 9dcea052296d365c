"""One rank of ``bench memory`` and of ``bench checkpoint --strategy fsdp``: a stack of ``--depth`` linear
blocks of ``--width`` trained with Adam under DDP or FSDP2, built the way ``ddp_slurm.train`` builds it
(``strategy.of(...).wrap``: DDP, or FSDP2 with the default units; ``optim.make_optimizer``, ``step.make_step``).

``--mode memory``: per-rank bytes of parameters, gradients and optimizer state (the local shards under
FSDP), peak memory (CUDA: ``max_memory_allocated``; CPU: peak RSS above the RSS before the model was
built), and time per step. With ``--accumulate N`` the step runs N micro-batches (``train.accumulate``)
and the gradient bytes are the most a rank held at any micro-batch boundary: its ``.grad`` tensors
plus any unsharded gradient FSDP keeps between micro-batches (``held_grad_bytes``). ``--mode checkpoint``: per-checkpoint stall of sharded saves through
``checkpoint.sharded_writer.ShardedCheckpointer``, synchronous and asynchronous (the call, plus what the background
write costs the steps that run beside it, against the same number of undisturbed steps).
Writes one JSON object to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_slurm import safefs
from ddp_slurm.distributed.groups import Groups
from ddp_slurm.exitcodes import exit_now
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.optim import make_optimizer, make_scheduler


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddp_slurm.bench.strategy_worker")
    p.add_argument("--mode", choices=["memory", "checkpoint"], default="memory")
    p.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (must divide --batch)")
    p.add_argument("--rounds", type=int, default=3, help="checkpoints per mode (--mode checkpoint)")
    p.add_argument("--dir", type=Path, default=None, help="run directory for checkpoints (--mode checkpoint)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held_grad_bytes(model: nn.Module) -> int:
    """Gradient bytes this rank holds now: every parameter's ``.grad`` (its local shard under FSDP) plus
    the unsharded gradients FSDP2 keeps between backward passes when gradient sync is off (FSDP's own
    ``unsharded_accumulated_grad`` / unsharded ``.grad``; private attributes, read defensively)."""
    held = sum(local_bytes(p.grad) for p in model.parameters())
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        for group in getattr(state(), "_fsdp_param_groups", []):
            for fsdp_param in group.fsdp_params:
                held += local_bytes(getattr(fsdp_param, "unsharded_accumulated_grad", None))
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                held += local_bytes(unsharded.grad if unsharded is not None else None)
    return held


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Any, Any, list[int]]:
    """The model, its optimizer, the step, and a one-item list the step keeps at the most gradient bytes
    held at a micro-batch boundary."""
    from ddp_slurm.config import TrainConfig
    from ddp_slurm.train import step, strategy
    from ddp_slurm.train.task import Task

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.depth)]
    model = nn.Sequential(*blocks, nn.Linear(args.width, 1)).to(device)
    net = strategy.of(args.strategy).wrap(model, Task(None, None), device, "fp32", dist.get_world_size())
    cfg = TrainConfig(schedule="constant", lr=1e-4)
    optimizer = make_optimizer(cfg, model.parameters(), device)
    scheduler = make_scheduler(cfg, optimizer, 10**9)
    held = [0]  # the most gradient bytes seen at a micro-batch boundary (--accumulate)

    def loss_of(m: nn.Module, b: Any) -> torch.Tensor:
        held[0] = max(held[0], held_grad_bytes(model))  # before this micro-batch: what the ones before left
        return (m(b[0]) - b[1]).pow(2).mean()

    train_step = step.make_step(net, optimizer, scheduler, loss_of, device, accumulate=args.accumulate)
    return model, optimizer, train_step, held


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def memory(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    base = rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, optimizer, train_step, held = build(args, device)
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(args.batch, args.width, device=device, generator=gen)
    y = torch.randn(args.batch, 1, device=device, generator=gen)
    for _ in range(2):  # warm-up: optimizer state exists, allocations settled
        train_step((x, y))
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        train_step((x, y)).item()
        times.append(time.perf_counter() - start)
    params = sum(local_bytes(p) for p in model.parameters())
    grads = max(held_grad_bytes(model), held[0])
    opt_state = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    )
    return {
        "param_bytes": params,
        "grad_bytes": grads,
        "optimizer_bytes": opt_state,
        "model_state_bytes": params + grads + opt_state,
        "peak_bytes": peak,
        "peak_kind": "cuda max_memory_allocated" if device.type == "cuda" else "peak RSS above the start",
        "step_s": sorted(times)[len(times) // 2],
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def checkpoint_stall(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Median stall of sharded saves, synchronous and asynchronous, on this rank."""
    from types import SimpleNamespace

    from ddp_slurm.train.checkpoint import listing, sharded
    from ddp_slurm.train.checkpoint.backends import Sharded
    from ddp_slurm.train.checkpoint.sharded_writer import ShardedCheckpointer
    from ddp_slurm.train.checkpoint.state import Position

    model, optimizer, train_step, _ = build(args, device)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randn(args.batch, 1, device=device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    backend = Sharded()
    task = SimpleNamespace(state_dict=dict)  # no state of its own
    run = SimpleNamespace(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        task=task,
        pos=Position(),
        device=device,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        seed=0,
        groups=Groups.make(device),
    )

    def steps(n: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            train_step((x, y)).item()
            run.pos.advance()
        return time.perf_counter() - start

    def capture() -> Any:
        return backend.capture(run, False, 0.0, {})

    steps(3)
    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        paths = RunPaths(args.dir / mode)

        def keep_two(newest: Path, paths: RunPaths = paths) -> None:  # every folder here is this benchmark's
            listing.prune(
                backend.candidates(paths),
                2,
                newest,
                summary_of=backend.summary,
                judge=lambda c, s: "",
                remove=sharded.remove,
            )

        if dist.get_rank() == 0:  # the run directory a training run takes first; its writers never make one
            safefs.make_dir(paths.root)
        dist.barrier()
        ckpt = ShardedCheckpointer(paths, enabled=mode == "async", prune=keep_two)
        stalls, calls = [], []
        for _ in range(args.rounds):
            quiet = steps(args.steps)
            dist.barrier()
            start = time.perf_counter()
            ckpt.save(capture())
            call = time.perf_counter() - start
            beside = steps(args.steps) if mode == "async" else quiet
            ckpt.wait()
            calls.append(call)
            stalls.append(call + max(0.0, beside - quiet))
        if mode == "async":  # a stop right after a save handed its write over: the worst moment
            ckpt.save(capture())
            start = time.perf_counter()
            train_step((x, y)).item()  # the step the ranks stop after
            run.pos.advance()
            ckpt.save(capture(), urgent=True)  # waits for the write in flight, then writes the stop step
            ckpt.wait()
            dist.barrier()
            out["stop_to_durable_s"] = time.perf_counter() - start
        ckpt.close()
        out[f"{mode}_stall_s"] = sorted(stalls)[len(stalls) // 2]
        out[f"{mode}_call_s"] = sorted(calls)[len(calls) // 2]
    folder = RunPaths(args.dir / "sync").checkpoints
    newest = sorted(folder.glob("step-*"))[-1]
    out["shard_bytes"] = sum(p.stat().st_size for p in newest.iterdir())
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    # Each rank its own GPU, or the CPUs for all: NCCL refuses two ranks on one GPU (2 ranks on a 1-GPU node)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    result = memory(args, device) if args.mode == "memory" else checkpoint_stall(args, device)
    result["device"] = str(device)  # where it was measured, in the JSON beside the figures
    args.out.write_text(json.dumps(result))
    dist.barrier()
    return 0


if __name__ == "__main__":
    exit_now(main())  # a finished gloo rank must not finalize (see exitcodes.exit_now)
