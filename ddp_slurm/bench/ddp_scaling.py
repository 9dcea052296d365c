"""``bench ddp``: weak scaling on one machine, 1 rank against 2 ranks with the same per-rank batch.

Each rank is a real process joined through ``ddp_slurm.distributed.group`` (gloo on CPU; nccl where there are
two GPUs) and trains with what ``ddp_slurm.train`` uses: ``ddp.wrap_ddp``, ``step.make_step`` (the MNIST
task's loss) and the loop's per-step ``vote.StopVote``. Every rank gets the same number of threads, half the machine's
CPUs: one rank with all of them would compare two cores against two times one core and measure how
well one process uses two cores, not what DDP costs.

The two world sizes are measured in the same launch, in alternating windows, because on a shared
machine the speed of the cores drifts by 10-30% over seconds (other tenants, caches, clocks), which
separate launches would read as a difference between the world sizes:
  1 rank   rank 0 alone trains its own model exactly as ``train`` does at world size 1 (no DDP, no
           collective) while rank 1 waits, idle, in a barrier;
  2 ranks  both ranks run the training step;
  compute  both ranks run the same step on the bare model: no collectives, no waiting for the other.
Efficiency is the median over windows of (1-rank step / 2-rank step), each pair measured seconds
apart. Communication = 2-rank step - compute: the gradient all-reduce, the stop vote and the wait for
the slower rank; a lone all-reduce of the gradients' size is timed too.

The workers are ``python -m ddp_slurm.bench.ddp_scaling --worker``; they write their timings as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ddp_slurm.bench import common, flags
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.distributed.group import distributed
from ddp_slurm.distributed.groups import Groups
from ddp_slurm.exitcodes import exit_now
from ddp_slurm.tasks.mnist import models
from ddp_slurm.train.signals import StopFlag
from ddp_slurm.train.vote import StopVote

WORLD = 2  # the 1-rank figures come from rank 0 of the same launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=models.MODELS, default="cnn")
    p.add_argument("--batch", type=flags.batch(WORLD), default=128, help="per-rank batch (default 128)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda (nccl) with two or more GPUs, else cpu (gloo)",
    )
    p.add_argument("--steps", type=flags.steps(), default=20, help="steps per measurement window (default 20)")
    p.add_argument("--windows", type=flags.count(), default=8, help="windows of each kind per launch (default 8)")
    p.add_argument("--repeats", type=flags.count(), default=2, help="launches (default 2)")
    p.add_argument("--warmup", type=flags.steps(0), default=5)
    p.add_argument("--timeout", type=flags.seconds(), default=900, help="seconds a launch may take (default 900)")


def launch(threads: int, device: str, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Start the two worker processes, wait for both, return their results (rank order)."""

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "ddp_slurm.bench.ddp_scaling", "--worker", "--out", str(out), "--device", device,
                "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
                "--windows", str(args.windows), "--warmup", str(args.warmup)]  # fmt: skip

    outs = common.run_local_ranks("ddp", WORLD, threads, tmp, "ddp", args.timeout, command)
    return [json.loads(out.read_text()) for out in outs]


def summarise(runs: list[list[dict[str, Any]]], batch: int) -> dict[str, Any]:
    """Per window: rank 0's lone step, the 2-rank step and compute (the slowest rank's: a synchronous
    step lasts as long as the slowest rank), paired into the efficiency."""
    solo, steps, computes, ratios, alone = [], [], [], [], []
    for ranks in runs:
        for w, lone in enumerate(ranks[0]["solo_s"]):
            step = max(r["step_s"][w] for r in ranks)
            solo.append(lone)
            steps.append(step)
            computes.append(max(r["compute_s"][w] for r in ranks))
            ratios.append(lone / step)
        alone.append(max(r["allreduce_s"] for r in ranks))
    step, compute = common.summary(steps)["median"], common.summary(computes)["median"]
    first = runs[0][0]
    one = {
        "per_rank_samples_per_s": common.summary([batch / s for s in solo]),
        "step_s": common.summary(solo)["median"],
        "threads_per_rank": first["threads"],
        "backend": "none (one process, no DDP)",
    }
    two = {
        "per_rank_samples_per_s": common.summary([batch / s for s in steps]),
        "step_s": step,
        "compute_s": compute,
        "communication_s": max(0.0, step - compute),
        "allreduce_alone_s": common.summary(alone)["median"],
        "threads_per_rank": first["threads"],
        "backend": first["backend"],
    }
    return {"ranks_1": one, "ranks_2": two, "efficiency_per_window": common.summary(ratios)}


def measure(args: argparse.Namespace, threads: int | None) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device if args.device != "auto" else ("cuda" if gpus >= 2 else "cpu")
    if device == "cuda" and gpus < 2:
        raise common.BenchError(f"--device cuda needs 2 GPUs for 2 ranks, torch sees {gpus}: use --device cpu")
    cpus = common.usable_cpus()
    per_rank = threads or max(1, cpus // 2)
    with tempfile.TemporaryDirectory(prefix="ddp_slurm-bench-") as tmp:
        runs = [launch(per_rank, device, args, Path(tmp)) for _ in range(args.repeats)]
    payload = common.header(
        "ddp",
        device,
        per_rank,
        model=args.model,
        per_rank_batch=args.batch,
        steps=args.steps,
        windows=args.windows,
        repeats=args.repeats,
        cpus=cpus,
    )
    payload.update(summarise(runs, args.batch))
    payload["efficiency"] = payload["efficiency_per_window"]["median"]
    if device == "cpu" and 2 * per_rank > cpus:
        payload["warning"] = f"2 ranks x {per_rank} thread(s) > {cpus} CPUs: the 2-rank run is oversubscribed"
    return payload


def render(p: dict[str, Any]) -> str:
    q, one, two = p["params"], p["ranks_1"], p["ranks_2"]
    title = (
        f"bench ddp: {q['model']}, per-rank batch {q['per_rank_batch']}, {p['device']} ({two['backend']}), "
        f"{p['threads']} thread(s) per rank; {q['repeats']} launch(es) x {q['windows']} windows of "
        f"{q['steps']} steps, 1 and 2 ranks alternating"
    )
    rows = [
        ["1", *common.fmt_spread(one["per_rank_samples_per_s"]), f"{1e3 * one['step_s']:.1f}", "-", "-", "-"],
        [
            "2",
            *common.fmt_spread(two["per_rank_samples_per_s"]),
            f"{1e3 * two['step_s']:.1f}",
            f"{1e3 * two['compute_s']:.1f}",
            f"{1e3 * two['communication_s']:.1f}",
            f"{1e3 * two['allreduce_alone_s']:.2f}",
        ],
    ]
    e = p["efficiency_per_window"]
    notes = [
        f"weak-scaling efficiency at 2 ranks: {100 * p['efficiency']:.0f}% (median over windows of 1-rank step / "
        f"2-rank step; {100 * e['min']:.0f}-{100 * e['max']:.0f}% across windows)",
        f"threads: {p['threads']} per rank in both ({q['cpus']} CPUs / 2 ranks); giving the lone rank all "
        f"{q['cpus']} would measure one process's use of {q['cpus']} cores, not DDP's cost",
        "step = the training loop's step (DDP step + stop vote); compute = the same step on the bare model, "
        "no collectives; communication = step - compute: the gradient all-reduce, the stop vote and "
        "waiting for the slower rank; 'alone' = one all-reduce of the gradients' size",
        f"load average {p['machine']['load_average_1m']}",
    ]
    if "warning" in p:
        notes.append("warning: " + p["warning"])
    return common.table(
        title,
        ["ranks", "samples/s/rank", "min-max", "spread", "step ms", "compute ms", "comm ms", "alone ms"],
        rows,
        notes,
    )


def worker(argv: list[str]) -> int:
    """One of the two ranks: time alternating windows (rank 0 alone, both training, both computing), write JSON."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m ddp_slurm.bench.ddp_scaling --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    add_arguments(p)
    args = p.parse_args(argv)
    env = DistEnv.from_environ(os.environ)
    backend = "nccl" if args.device == "cuda" else "gloo"
    with distributed(env, backend, timeout_s=args.timeout) as (device, backend):
        if args.device == "cpu":
            device = torch.device("cpu")  # a GPU machine benchmarking its CPUs
        B, ws = args.batch, env.world_size
        groups = Groups.make(device)  # as the training loop names them
        model, _, step, bare, batches = common.mnist_trainer(args.model, B * ws, env.rank, ws, device, groups.train)
        votes = StopVote(StopFlag(), ws, device, group=groups.train)  # no handlers: nobody signals a benchmark
        if env.rank == 0:  # the 1-rank run: its own model, no DDP, as ddp_slurm.train trains one process
            _, _, solo, _, solo_batches = common.mnist_trainer(args.model, B, 0, 1, device)
            solo_votes = StopVote(StopFlag(), 1, device)

        def run(fn, source: Iterator[Any], vote: StopVote | None, n: int) -> None:
            for i in range(n):
                loss = fn(next(source))
                if vote is not None:
                    vote.exchange(loss, i)
            if vote is not None:
                vote.settle()

        def window(fn, n: int, lone: bool = False) -> float:
            dist.barrier(group=groups.host)  # the ranks start each window together
            if lone and env.rank != 0:
                seconds = 0.0
            else:
                seconds = common.timed(lambda: fn(n), device) / n
            if lone:
                dist.barrier(group=groups.host)  # rank 1 waits here, idle, while rank 0 trains alone
            return seconds

        kinds = {
            "solo_s": (lambda n: run(solo, solo_batches, solo_votes, n), True),
            "step_s": (lambda n: run(step, batches, votes, n), False),
            "compute_s": (lambda n: run(bare, batches, None, n), False),
        }
        for fn, lone in kinds.values():
            window(fn, args.warmup, lone)
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.windows):
            for name, (fn, lone) in kinds.items():
                times[name].append(window(fn, args.steps, lone))
        grads = torch.zeros(sum(p.numel() for p in model.parameters()), device=device)
        reps = 20
        allreduce_s = window(lambda n: [dist.all_reduce(grads, group=groups.train) for _ in range(n)], reps)
        args.out.write_text(
            json.dumps(
                {
                    "rank": env.rank,
                    "world": ws,
                    "threads": torch.get_num_threads(),
                    "backend": backend,
                    "device": str(device),
                    **times,
                    "allreduce_s": allreduce_s,
                }
            )
        )
    return 0


if __name__ == "__main__":
    if "--worker" not in sys.argv[1:]:
        sys.exit("this module is the worker of `python -m ddp_slurm.bench ddp`; run that instead")
    code = worker(sys.argv[1:])
    exit_now(code)  # a finished gloo rank must not finalize (see exitcodes.exit_now)
