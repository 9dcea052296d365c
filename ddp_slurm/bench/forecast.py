"""Scaling forecast: the step time and weak-scaling efficiency to expect at 1, 2, 4, ... 1024 nodes.

Run it inside an allocation, one process per rank as training runs (``srun python -m ddp_slurm.bench
forecast``, or torchrun; alone it measures one process). Every rank measures, rank 0 reports:
- compute: the training step of the task's model without DDP (``ddp_slurm.train``'s own step on the
  bundled MNIST sample), and the forward part of it; the slowest rank's median;
- gradients: their bytes and the DDP buckets they travel in;
- the all-reduce between the ranks at several message sizes, fitted to ``t = a + b * bytes``, which a
  ring all-reduce over p ranks reads as latency ``alpha = a / 2(p-1)`` per hop and inverse bandwidth
  ``beta = b * p / 2(p-1)`` per byte;
- where there is more than one rank, the real DDP step, to check the model where it was measured.

Model (docs/forecast.md): each bucket is one ring all-reduce, ``2(p-1) alpha + 2(p-1)/p * bytes *
beta``; buckets travel while backward still runs, so only the part of the communication that does
not fit in the backward time, and never less than the last bucket, adds to the compute time. Weak
scaling: the per-rank batch stays the same; efficiency = step at 1 node / step at N nodes.
``--from A.json[,B.json]`` forecasts from saved measurements: compute from the one with the fewest
ranks, alpha and beta from the one with the most.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

import torch

from ddp_slurm import argtypes
from ddp_slurm.bench import common, flags, forecast_saved
from ddp_slurm.distributed.groups import Groups
from ddp_slurm.text import counted
from ddp_slurm.train.ddp import bucket_cap_mb

DDP_FIRST_BUCKET = 1 << 20  # DDP's first bucket, then 25 MiB ones (torch's defaults)
DDP_BUCKET = 25 << 20
MAX_NODES, MAX_RANKS_PER_NODE = 1 << 20, 1 << 10  # of the forecast, not of what runs here


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ddp_slurm.tasks.mnist import models

    mib, why = argtypes.memory_mib()
    p.add_argument("--model", choices=models.MODELS, default="cnn")
    p.add_argument("--batch", type=flags.batch(), default=128, help="per-rank batch (default 128)")
    p.add_argument("--steps", type=flags.steps(), default=10, help="steps per timing window (default 10)")
    p.add_argument("--windows", type=flags.count(), default=5, help="timing windows (default 5)")
    p.add_argument(
        "--sizes-kib",
        type=argtypes.integers(1, int(mib * 1024), why.replace("MiB", "KiB")),
        default="4,64,1024,8192",
        help="all-reduce message sizes in KiB",
    )
    p.add_argument("--max-nodes", type=argtypes.integer(1, MAX_NODES), default=1024)
    p.add_argument(
        "--ranks-per-node",
        type=argtypes.integer(1, MAX_RANKS_PER_NODE),
        default=None,
        help="for the forecast (default: as measured)",
    )
    p.add_argument(
        "--from",
        dest="sources",
        type=forecast_saved.sources,
        default=None,
        metavar="A.json[,B.json]",
        help="forecast from saved runs",
    )


# ---------------------------------------------------------------- the model


def buckets(grad_bytes: int, cap_mb: float | None) -> list[int]:
    """Bytes of each DDP bucket, in the order they are all-reduced (last layers' first)."""
    if cap_mb is not None:
        cap = int(cap_mb * 2**20)
        sizes = [cap] * (grad_bytes // cap) + ([grad_bytes % cap] if grad_bytes % cap else [])
        return sizes or [grad_bytes]
    sizes, left = [min(grad_bytes, DDP_FIRST_BUCKET)], grad_bytes - min(grad_bytes, DDP_FIRST_BUCKET)
    while left > 0:
        sizes.append(min(left, DDP_BUCKET))
        left -= sizes[-1]
    return sizes


def ring_s(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` over ``p`` ranks."""
    return 0.0 if p <= 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def step_s(p: int, m: dict[str, Any]) -> tuple[float, float]:
    """(predicted step seconds, exposed communication seconds) at ``p`` ranks."""
    if p <= 1:
        return m["compute_s"], 0.0
    per_bucket = [ring_s(p, b, m["alpha_s"], m["beta_s_per_byte"]) for b in m["buckets"]]
    backward = m["compute_s"] - m["forward_s"]
    exposed = max(per_bucket[-1], sum(per_bucket) - backward)
    return m["compute_s"] + exposed, exposed


def forecast(m: dict[str, Any], ranks_per_node: int, max_nodes: int) -> list[dict[str, Any]]:
    rows, base = [], step_s(ranks_per_node, m)[0]
    nodes = 1
    while nodes <= max_nodes:
        p = nodes * ranks_per_node
        t, exposed = step_s(p, m)
        rows.append({"nodes": nodes, "ranks": p, "step_s": t, "comm_exposed_s": exposed, "efficiency": base / t})
        nodes *= 2
    return rows


def fit(sizes: list[int], seconds: list[float], p: int) -> dict[str, float]:
    """Least squares ``t = a + b * bytes``; alpha and beta of a ring over ``p`` ranks."""
    n, mx, my = len(sizes), statistics.fmean(sizes), statistics.fmean(seconds)
    sxx = sum((x - mx) ** 2 for x in sizes)
    b = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx if n > 1 and sxx else 0.0
    a = max(my - b * mx, 0.0)
    b = max(b, 0.0)
    return {"a_s": a, "b_s_per_byte": b, "alpha_s": a / (2 * (p - 1)), "beta_s_per_byte": b * p / (2 * (p - 1))}


# ---------------------------------------------------------------- measuring


def _window(fn, n: int, device: torch.device) -> float:
    return common.timed(lambda: [fn() for _ in range(n)], device) / n


def _slowest(value: float, world: int, group: Any) -> float:
    import torch.distributed as dist

    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # a host tensor: the host group
    return float(t.item())


def measure_ranks(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank measures; rank 0 returns the figures, the others None."""
    import torch.distributed as dist

    from ddp_slurm.distributed.env import DistEnv
    from ddp_slurm.distributed.group import distributed
    from ddp_slurm.tasks.mnist import data

    env = DistEnv.from_environ(os.environ)
    ws = env.world_size
    if args.batch * ws > data.TRAIN_SIZES["sample"]:
        raise common.BenchError(
            f"--batch {args.batch} x {ws} ranks: more than the bundled sample's {data.TRAIN_SIZES['sample']} images"
        )
    with distributed(env, "auto", timeout_s=300) as (device, backend):
        train = data.load_sample(train=True).to(device)
        groups = Groups.make(device)  # as the training loop names them
        host = groups.host
        model, _, ddp_step, bare, batches = common.mnist_trainer(
            args.model, args.batch * ws, env.rank, ws, device, groups.train
        )
        x, y = data.normalize(train.images[: args.batch]), train.labels[: args.batch]

        def forward() -> None:  # as in the step: autograd records the graph; backward is the rest
            torch.nn.functional.cross_entropy(model(x), y)

        for _ in range(3):
            bare(next(batches))
            ddp_step(next(batches))
        compute = [_window(lambda: bare(next(batches)), args.steps, device) for _ in range(args.windows)]
        fwd = [_window(forward, args.steps, device) for _ in range(args.windows)]
        measured = [_window(lambda: ddp_step(next(batches)), args.steps, device) for _ in range(args.windows)]
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        sizes = [k * 1024 for k in args.sizes_kib]
        allreduce = []
        for size in sizes:
            buf = torch.ones(size // 4, device=device)
            reps = max(3, min(20, (64 << 20) // size))
            if ws > 1:
                dist.all_reduce(buf, group=groups.train)
                dist.barrier(group=host)
            per_op = [
                _window(lambda: dist.all_reduce(buf, group=groups.train) if ws > 1 else None, reps, device)
                for _ in range(3)
            ]
            allreduce.append(_slowest(statistics.median(per_op), ws, host))
        result = {
            "world_size": ws,
            "nodes": env.num_nodes,
            "ranks_per_node": env.local_world_size,
            "backend": backend,
            "device": str(device),
            "model": args.model,
            "batch_per_rank": args.batch,
            "compute_s": _slowest(statistics.median(compute), ws, host),
            "forward_s": _slowest(statistics.median(fwd), ws, host),
            "measured_step_s": _slowest(statistics.median(measured), ws, host) if ws > 1 else None,
            "grad_bytes": grad_bytes,
            "buckets": buckets(grad_bytes, bucket_cap_mb(model)),
            "allreduce": [{"bytes": s, "s": t} for s, t in zip(sizes, allreduce)],
        }
        if ws > 1:
            result.update(fit(sizes, allreduce, ws))
            dist.barrier(group=host)
    return result if env.rank == 0 else None


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Compute from the run with the fewest ranks, alpha and beta from the one with the most."""
    few = min(runs, key=lambda r: r["world_size"])
    many = max(runs, key=lambda r: r["world_size"])
    if many["world_size"] < 2:
        raise common.BenchError("no all-reduce was measured: run it on 2 or more ranks (srun -N2 ...)")
    m = dict(many)
    m.update({k: few[k] for k in ("compute_s", "forward_s")})
    m["compute_from_world_size"] = few["world_size"]
    return m


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any] | None:
    if args.sources:
        runs = [forecast_saved.read(name) for name in args.sources]
    else:
        started = time.monotonic()
        result = measure_ranks(args)
        if result is None:
            return None  # not rank 0: rank 0 reports
        result["measure_s"] = time.monotonic() - started
        runs = [result]
    m = combine(runs) if len(runs) > 1 or runs[0]["world_size"] > 1 else runs[0]
    rpn = args.ranks_per_node or m["ranks_per_node"]
    payload = common.header("forecast", m["device"], threads, model=m["model"], batch_per_rank=m["batch_per_rank"])
    payload["measured"] = runs[0] if len(runs) == 1 else m
    if "alpha_s" not in m:
        payload["forecast"] = []
        payload["note"] = "one rank: no all-reduce to measure; run it on 2 or more nodes (srun -N2 ...)"
        return payload
    payload["ranks_per_node"] = rpn
    payload["forecast"] = forecast(m, rpn, args.max_nodes)
    if m.get("measured_step_s"):
        predicted = step_s(m["world_size"], m)[0]
        payload["check"] = {
            "world_size": m["world_size"],
            "predicted_s": predicted,
            "measured_s": m["measured_step_s"],
            "error": predicted / m["measured_step_s"] - 1,
        }
    return payload


def render(p: dict[str, Any]) -> str:
    m = p["measured"]
    head = (
        f"forecast for {m['model']}, batch {m['batch_per_rank']} per rank, {m['backend']} on {m['device']}: "
        f"compute {1e3 * m['compute_s']:.1f} ms/step, gradients {m['grad_bytes'] / 2**20:.2f} MiB in "
        f"{len(m['buckets'])} bucket(s)"
    )
    if not p["forecast"]:
        return f"{head}\n  {p['note']}"
    notes = [
        f"all-reduce measured over {counted(m['world_size'], 'rank')} on {m['nodes']} node(s): alpha {1e6 * m['alpha_s']:.0f} us, "
        f"bandwidth {1 / m['beta_s_per_byte'] / 2**20 if m['beta_s_per_byte'] else math.inf:,.0f} MiB/s",
    ]
    if "check" in p:
        c = p["check"]
        notes.append(
            f"at the measured {counted(c['world_size'], 'rank')}: predicted {1e3 * c['predicted_s']:.1f} ms, measured "
            f"{1e3 * c['measured_s']:.1f} ms ({100 * c['error']:+.0f}%)"
        )
    rows = [
        [
            str(r["nodes"]),
            str(r["ranks"]),
            common.fmt(1e3 * r["step_s"], 1),
            common.fmt(1e3 * r["comm_exposed_s"], 1),
            f"{100 * r['efficiency']:.0f}%",
        ]
        for r in p["forecast"]
    ]
    return common.table(head, ["nodes", "ranks", "step ms", "exposed comm ms", "efficiency"], rows, notes)
