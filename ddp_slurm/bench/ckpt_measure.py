"""The measuring rank of ``python -m ddp_slurm.bench checkpoint`` (one process per rank; rank 0 writes).

Phases, all in one process so that they share the state, the disk and the machine's load:
undisturbed steps (the baseline step time), ``--rounds`` synchronous saves (rank 0 writes the two
raw files of the same size right before each: the disk's limit under the same conditions),
one asynchronous save that allocates the writer's host buffers (reported on its own), then ``--rounds``
asynchronous saves that reuse them, each followed by steps. Every step ends with the ranks' flag exchange, as the
training loop's does, so a rank that is held up holds the others up too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.bench import common
from ddp_slurm.bench.checkpoint_stall import KEEP, raw_write_s
from ddp_slurm.bench.ckpt_worker import Trainer, exchange, set_threads
from ddp_slurm.exitcodes import exit_now
from ddp_slurm.train import checkpoint
from ddp_slurm.train.checkpoint.wholefile_writer import AsyncCheckpointer

WARMUP, BASELINE, SETTLE = 10, 30, 5


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def private_bytes(pid: int) -> int:
    """Memory that only process ``pid`` holds (a forked writer: the pages training has changed since
    the fork, which the kernel copied, and the writer's own allocations); 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) * 1024 for line in f if line.startswith(("Private_Clean", "Private_Dirty")))
    except (OSError, ValueError, IndexError):
        return 0


class PeakRss:
    """Samples this process's RSS, plus a writer process's private memory, every 10 ms in a thread."""

    def __init__(self, writer_pid: Callable[[], int | None]) -> None:
        self.base, self.peak, self._stop = rss_bytes(), 0, threading.Event()
        self._writer_pid = writer_pid
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        pid = self._writer_pid()
        return rss_bytes() - self.base + (private_bytes(pid) if pid else 0)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.sample())

    def stop(self) -> int:
        """The peak extra memory since the start."""
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.sample())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_slurm.bench.ckpt_measure")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--state-mb", type=float, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--writer", choices=("process", "thread"), default=None, help="default: checkpoint.wholefile_writer's"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives")
    args = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    set_threads()
    if world > 1:
        dist.init_process_group("gloo")
    tr = Trainer(args.width, args.batch, args.state_mb, 0, world, args.device)

    def step(done: bool = False) -> bool:
        tr.train_step(rank)
        return exchange([float(done)], world)[0]

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    for _ in range(WARMUP):
        step()
    baseline = []
    for _ in range(BASELINE):
        t = time.perf_counter()
        step()
        baseline.append(time.perf_counter() - t)
    step_s = statistics.median(baseline)

    sync: list[float] = []
    raw: dict[bool, list[float]] = {False: [], True: []}
    raw_dir, nbytes = args.run_dir / "raw", int(args.state_mb * 2**20)
    file_bytes = 0
    for i in range(args.rounds):
        if rank == 0:
            raw_dir.mkdir(parents=True, exist_ok=True)
            for behind in (False, True):
                raw[behind].append(raw_write_s(raw_dir, nbytes, 2 * i + behind, behind))
        barrier()
        t = time.perf_counter()
        if rank == 0:
            file_bytes = checkpoint.save(args.run_dir, tr.state(), keep=KEEP).stat().st_size
        step()  # the other ranks wait in this step's exchange for rank 0
        sync.append(time.perf_counter() - t - step_s)
        for _ in range(SETTLE):
            step()

    ckpt = AsyncCheckpointer(args.run_dir, keep=KEEP, writer=args.writer)
    stall: list[float] = []
    snapshot: list[float] = []
    steps_in_write: list[tuple[int, float]] = []
    peak = PeakRss(lambda: ckpt.writer_pid)
    for _ in range(1 + args.rounds):
        barrier()
        t0 = time.perf_counter()
        if rank == 0:
            ckpt.save(tr.state())
        if args.device == "cuda":  # the copy to pinned host memory is queued: its time is when it has landed
            torch.cuda.synchronize()  # (the next step would wait behind it on the stream all the same)
        t1 = time.perf_counter()
        n = 0
        while not step(rank == 0 and ckpt.poll() is not None):  # until rank 0's write is durable
            n += 1
        n += 1
        end = time.perf_counter()
        for _ in range(SETTLE):
            step()
        # As many steps again, undisturbed: what those steps cost without a write. Their median, not their
        # sum: a hiccup of this shared machine in the reference would otherwise hide part of the stall.
        reference = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            reference.append(time.perf_counter() - t)
        undisturbed = n * statistics.median(reference)
        stall.append(end - t0 - undisturbed)
        snapshot.append(t1 - t0)
        steps_in_write.append((n, end - t1, undisturbed))
    extra = peak.stop()
    ckpt.close()
    first_stall, first_snapshot = stall.pop(0), snapshot.pop(0)  # the save that allocated the host buffers
    steps_in_write.pop(0)
    n_all = sum(n for n, _, _ in steps_in_write)
    slowdown = sum(s for _, s, _ in steps_in_write) / sum(u for _, _, u in steps_in_write)
    result: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "step_s": step_s,
        "file_bytes": file_bytes,
        "sync_stall_s": common.summary(sync),
        "raw_write_s": common.summary(raw[False] or [0.0]),
        "raw_write_behind_s": common.summary(raw[True] or [0.0]),
        "async_stall_s": common.summary(stall),
        "snapshot_s": common.summary(snapshot),
        "first_async_stall_s": first_stall,
        "first_snapshot_s": first_snapshot,
        "steps_during_write": n_all,
        "step_slowdown_during_write": slowdown,
        "async_peak_extra_rss_bytes": extra,
        "writer": ckpt.writer,
    }
    args.out.write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    exit_now(code)  # a finished gloo rank must not finalize (see exitcodes.exit_now)
