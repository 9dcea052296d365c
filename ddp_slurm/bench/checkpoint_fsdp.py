"""``bench checkpoint --strategy fsdp``: the stall of sharded checkpoints (``train/checkpoint/sharded.py``), asynchronous
(DCP's ``async_save``: host copy, then a background write and commit) against synchronous, per world size.

Each world size starts that many local ranks of ``ddp_slurm.bench.strategy_worker --mode checkpoint``:
a stack of 8 linear blocks sized so that parameters plus Adam's two moments come to ``--state-mb`` MiB,
trained under FSDP2. Stall per checkpoint: synchronous, the time the save blocks (every rank writes its
shard, rank 0 commits); asynchronous, the time the call blocks (the copy to host memory and DCP's
planning) plus what the background write costs the steps that run beside it, against as many
undisturbed steps just before. The slowest rank's median counts. ``stall_ratio`` = async / sync at
the first world size. Stop to durable: a stop right after an asynchronous save handed its write over
(the worst moment): one more step, then the stop step's save, which waits for the write in flight
(a sharded write cannot be cancelled) and writes its own, until it is committed.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

from ddp_slurm.bench import common
from ddp_slurm.bench.memory import run_ranks

DEPTH = 8
STATE_BYTES_PER_PARAM = 12  # fp32 parameter + Adam's two fp32 moments


def measure(args: argparse.Namespace, threads: int | None, worlds: list[int]) -> dict[str, Any]:
    width = max(8, int(math.sqrt(args.state_mb * 2**20 / STATE_BYTES_PER_PARAM / DEPTH)))
    base = args.dir or Path.cwd()
    by_world = {}
    with tempfile.TemporaryDirectory(prefix=".bench-checkpoint-fsdp-", dir=base) as tmp:
        for world in worlds:
            extra = ["--width", str(width), "--depth", str(DEPTH), "--steps", "5", "--rounds", str(args.rounds)]
            extra += ["--dir", str(Path(tmp) / f"w{world}")]
            ranks = run_ranks("checkpoint", "fsdp", world, threads or 1, Path(tmp), args.timeout, extra)
            by_world[str(world)] = {
                key: max(r[key] for r in ranks)
                for key in (
                    "sync_stall_s",
                    "async_stall_s",
                    "sync_call_s",
                    "async_call_s",
                    "shard_bytes",
                    "stop_to_durable_s",
                )
            }
    payload = common.header(
        "checkpoint", "cpu", threads or 1, strategy="fsdp", state_mb=args.state_mb, rounds=args.rounds, worlds=worlds
    )
    first = by_world[str(worlds[0])]
    payload.update(
        {
            "strategy": "fsdp",
            "directory": str(base),
            "width": width,
            "worlds": by_world,
            "sync_stall_s": first["sync_stall_s"],
            "async_stall_s": first["async_stall_s"],
            "stall_ratio": first["async_stall_s"] / first["sync_stall_s"],
        }
    )
    return payload


def render(p: dict[str, Any]) -> str:
    rows = [
        [
            f"world size {w}",
            common.fmt(r["shard_bytes"] / 2**20, 1),
            common.fmt(r["sync_stall_s"], 3),
            common.fmt(r["async_stall_s"], 3),
            common.fmt(r["async_call_s"], 3),
            f"{r['async_stall_s'] / r['sync_stall_s']:.3f}",
            common.fmt(r["stop_to_durable_s"], 3),
        ]
        for w, r in p["worlds"].items()
    ]
    return common.table(
        f"sharded checkpoint stall (dist.strategy=fsdp), {p['params']['state_mb']:g} MiB of state, in {p['directory']}",
        ["", "on disk MiB", "sync stall s", "async stall s", "async call s", "ratio", "stop to durable s"],
        rows,
        [f"stall_ratio (world size {next(iter(p['worlds']))}) = {p['stall_ratio']:.3f}"],
    )
