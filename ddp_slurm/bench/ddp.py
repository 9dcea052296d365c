"""``bench ddp``: weak scaling on one machine, 1 rank against 2 ranks with the same per-rank batch.

Each rank is a real process joined through ``ddp_slurm.bootstrap`` (gloo on CPU; nccl where there are
two GPUs) and trains with what ``ddp_slurm.train`` uses: ``engine.wrap_ddp`` (the bare model for one
rank) and ``engine.make_step``. Every rank gets the same number of threads in both runs, half the
machine's CPUs: one rank with all of them would compare two cores against two times one core and
measure how well one process uses two cores, not what DDP costs. Step time is split into compute (the
same step on the bare model: no collective at all, so no waiting for the other rank either) and
communication (the rest: the gradient all-reduce not hidden behind the backward pass, DDP's broadcast
of batch-norm buffers, and the wait for the slower rank); a lone all-reduce of the gradients' size is
timed too.

The workers are ``python -m ddp_slurm.bench.ddp --worker``; they write their timings as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from .. import bootstrap, config, data, engine, models
from . import common


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=models.MODELS, default="cnn")
    p.add_argument("--batch", type=int, default=128, help="per-rank batch (default 128)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda (nccl) with two or more GPUs, else cpu (gloo)")
    p.add_argument("--steps", type=int, default=20, help="steps per measurement window (default 20)")
    p.add_argument("--windows", type=int, default=3, help="windows of each kind per launch (default 3)")
    p.add_argument("--repeats", type=int, default=2, help="launches of each world size, alternating (default 2)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900, help="seconds a launch may take (default 900)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, threads: int, device: str, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Start ``world`` worker processes, wait for all, return their results (rank order)."""
    port, procs, outs = _free_port(), [], []
    for rank in range(world):
        out, log = tmp / f"w{world}-r{rank}-{port}.json", tmp / f"w{world}-r{rank}-{port}.log"
        env = common.child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                               OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "ddp_slurm.bench.ddp", "--worker", "--out", str(out), "--device", device,
               "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
               "--windows", str(args.windows), "--warmup", str(args.warmup)]
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
        outs.append((out, log))
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [None] * world
    finally:
        for p in procs:  # only our own workers, by their process handles
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (code, (out, log)) in enumerate(zip(codes, outs)):
        if code != 0:
            tail = log.read_text().strip().splitlines()[-5:]
            why = f"exit {code}" if code is not None else f"no result after {args.timeout:g} s"
            raise common.BenchError(f"ddp worker rank {rank}/{world} failed ({why}): {' | '.join(tail)}")
    return [json.loads(out.read_text()) for out, _ in outs]


def summarise(runs: list[list[dict[str, Any]]], batch: int) -> dict[str, Any]:
    """Per-rank samples/s per window (mean over ranks), step/compute medians, all-reduce alone."""
    rates, steps, computes, alone, flags = [], [], [], [], []
    for ranks in runs:
        for w in range(len(ranks[0]["step_s"])):
            rates.append(sum(batch / r["step_s"][w] for r in ranks) / len(ranks))
            steps.append(max(r["step_s"][w] for r in ranks))  # a synchronous step lasts as long as the slowest rank
            computes.append(max(r["compute_s"][w] for r in ranks))
        alone.append(max(r["allreduce_s"] for r in ranks))
        flags.append(max(r["flags_s"] for r in ranks))
    step, compute = common.summary(steps)["median"], common.summary(computes)["median"]
    return {"per_rank_samples_per_s": common.summary(rates), "step_s": step, "compute_s": compute,
            "communication_s": max(0.0, step - compute), "allreduce_alone_s": common.summary(alone)["median"],
            "loop_flags_s": common.summary(flags)["median"], "threads_per_rank": runs[0][0]["threads"],
            "backend": runs[0][0]["backend"]}


def measure(args: argparse.Namespace, threads: int | None) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device if args.device != "auto" else ("cuda" if gpus >= 2 else "cpu")
    if device == "cuda" and gpus < 2:
        raise common.BenchError(f"--device cuda needs 2 GPUs for 2 ranks, torch sees {gpus}: use --device cpu")
    cpus = common.usable_cpus()
    per_rank = threads or max(1, cpus // 2)
    results: dict[int, list[list[dict[str, Any]]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="ddp_slurm-bench-") as tmp:
        for _ in range(args.repeats):
            for world in (1, 2):  # alternating, so slow drifts in the machine's load hit both
                results[world].append(launch(world, per_rank, device, args, Path(tmp)))
    one, two = summarise(results[1], args.batch), summarise(results[2], args.batch)
    payload = common.header("ddp", device, per_rank, model=args.model, per_rank_batch=args.batch, steps=args.steps,
                            windows=args.windows, repeats=args.repeats, cpus=cpus)
    payload.update({"ranks_1": one, "ranks_2": two,
                    "efficiency": two["per_rank_samples_per_s"]["median"] / one["per_rank_samples_per_s"]["median"]})
    if device == "cpu" and 2 * per_rank > cpus:
        payload["warning"] = f"2 ranks x {per_rank} thread(s) > {cpus} CPUs: the 2-rank run is oversubscribed"
    return payload


def render(p: dict[str, Any]) -> str:
    q = p["params"]
    title = (f"bench ddp: {q['model']}, per-rank batch {q['per_rank_batch']}, {p['device']} "
             f"({p['ranks_2']['backend']}), {p['threads']} thread(s) per rank; {q['repeats']} launches per world "
             f"size x {q['windows']} windows of {q['steps']} steps")
    rows = []
    for n in (1, 2):
        r = p[f"ranks_{n}"]
        rows.append([str(n), *common.fmt_spread(r["per_rank_samples_per_s"]), f"{1e3 * r['step_s']:.1f}",
                     f"{1e3 * r['compute_s']:.1f}", f"{1e3 * r['communication_s']:.1f}",
                     f"{1e3 * r['allreduce_alone_s']:.2f}"])
    notes = [f"weak-scaling efficiency at 2 ranks: {100 * p['efficiency']:.0f}% (per-rank samples/s, 2 ranks / 1 rank)",
             f"threads: {p['threads']} per rank in both runs ({q['cpus']} CPUs / 2 ranks); giving the lone rank all "
             f"{q['cpus']} would measure one process's use of {q['cpus']} cores, not DDP's cost",
             "compute = the step on the bare model (no collectives); communication = step - compute: the "
             "all-reduce not hidden behind the backward pass, DDP's buffer broadcast, and waiting for the "
             "slower rank; 'alone' = one all-reduce of the gradients' size",
             f"the training loop adds one 3-float all-reduce per step for stop signals: "
             f"{1e3 * p['ranks_2']['loop_flags_s']:.2f} ms at 2 ranks",
             f"load average {p['machine']['load_average_1m']}"]
    if "warning" in p:
        notes.append("warning: " + p["warning"])
    return common.table(title, ["ranks", "samples/s/rank", "min-max", "spread", "step ms", "compute ms",
                                "comm ms", "alone ms"], rows, notes)


def worker(argv: list[str]) -> int:
    """One rank: train, time windows with and without the gradient all-reduce, write JSON."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m ddp_slurm.bench.ddp --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    add_arguments(p)
    args = p.parse_args(argv)
    env = bootstrap.DistEnv.from_environ(os.environ)
    backend = "nccl" if args.device == "cuda" else "gloo"
    with bootstrap.distributed(env, backend, timeout_s=args.timeout) as (device, backend):
        if args.device == "cpu":
            device = torch.device("cpu")  # a GPU machine benchmarking its CPUs
        G = args.batch * env.world_size
        cfg = config.load(overrides=[f"model.name={args.model}", f"train.global_batch_size={G}"])
        train = data.load_sample(train=True).to(device)
        torch.manual_seed(cfg.run.seed)
        model = models.build(args.model).to(device)
        optimizer = engine.make_optimizer(cfg.train, model.parameters(), device)
        scheduler = engine.make_scheduler(cfg.train, optimizer, 10**9)  # its length does not change the cost
        net = engine.wrap_ddp(model, device, env.world_size)
        step = engine.make_step(net, optimizer, scheduler, train.images, train.labels, cfg.train.precision)
        # The same step on the module inside DDP: DDP's hooks stay idle when its forward is bypassed.
        bare = engine.make_step(model, optimizer, scheduler, train.images, train.labels, cfg.train.precision)
        per_epoch = data.steps_per_epoch(len(train), G)
        position = {"epoch": 0, "i": 0, "perm": data.epoch_permutation(len(train), cfg.run.seed, 0).to(device)}

        def run(n: int, communicate: bool = True) -> None:
            fn = step if communicate else bare
            for _ in range(n):
                if position["i"] == per_epoch:
                    position["epoch"] += 1
                    position["i"] = 0
                    perm = data.epoch_permutation(len(train), cfg.run.seed, position["epoch"])
                    position["perm"] = perm.to(device)
                fn(data.rank_batch(position["perm"], position["i"], G, env.rank, env.world_size))
                position["i"] += 1

        def window(fn) -> float:
            if env.world_size > 1:
                dist.barrier()  # the ranks start each window together
            return common.timed(fn, device)

        run(args.warmup)
        step_s, compute_s = [], []
        for _ in range(args.windows):
            step_s.append(window(lambda: run(args.steps)) / args.steps)
            compute_s.append(window(lambda: run(args.steps, communicate=False)) / args.steps)
        grads = torch.zeros(sum(p.numel() for p in model.parameters()), device=device)
        reps = 20
        allreduce_s = window(lambda: [dist.all_reduce(grads) for _ in range(reps)]) / reps
        flags = torch.zeros(3, device=device)  # what train.sync_flags does every step
        flags_s = window(lambda: [(dist.all_reduce(flags, op=dist.ReduceOp.MAX), flags.tolist())
                                  for _ in range(reps)]) / reps
        args.out.write_text(json.dumps({"rank": env.rank, "world": env.world_size, "threads": torch.get_num_threads(),
                                        "backend": backend, "device": str(device), "step_s": step_s,
                                        "compute_s": compute_s, "allreduce_s": allreduce_s, "flags_s": flags_s}))
    return 0


if __name__ == "__main__":
    if "--worker" not in sys.argv[1:]:
        sys.exit("this module is the worker of `python -m ddp_slurm.bench ddp`; run that instead")
    sys.exit(worker(sys.argv[1:]))
