"""The measuring rank of ``python -m ddp_slurm.bench checkpoint`` (one process per rank; rank 0 writes).

Phases, all in one process so that they share the state, the disk and the machine's load:
undisturbed steps (the baseline step time), ``--rounds`` synchronous saves, ``--rounds``
asynchronous saves, each followed by steps. Every step ends with the ranks' flag exchange, as the
training loop's does, so a rank that is held up holds the others up too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm.bench import common
from ddp_slurm.bench.ckpt_worker import Trainer, exchange
from ddp_slurm.train import checkpoint
from ddp_slurm.train.ckpt_async import AsyncCheckpointer

WARMUP, BASELINE, SETTLE = 10, 30, 5


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's RSS every 2 ms in a thread; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_bytes())


class ForkWriter:
    """For comparison only: the writer as a forked child (the state is shared copy-on-write, so there is
    no copy; the child has its own GIL). Not what ddp_slurm uses: see ckpt_async's docstring."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.run_dir, self.keep, self.pid = run_dir, keep, 0

    def save(self, state: dict[str, Any]) -> None:
        self.close()
        pid = os.fork()
        if pid == 0:  # the child: write, and leave without running any of the parent's cleanup
            code = 1
            try:
                checkpoint.save(self.run_dir, state, self.keep)
                code = 0
            finally:
                os._exit(code)
        self.pid = pid

    def poll(self) -> Path | None:
        if self.pid and os.waitpid(self.pid, os.WNOHANG)[0]:
            self.pid = 0
            return self.run_dir
        return None

    def close(self) -> None:
        if self.pid:
            os.waitpid(self.pid, 0)
            self.pid = 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_slurm.bench.ckpt_measure")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--state-mb", type=float, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--writer", choices=("thread", "fork"), default="thread")
    args = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo")
    tr = Trainer(args.width, args.batch, args.state_mb, 0, world)

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
    file_bytes = 0
    for _ in range(args.rounds):
        barrier()
        t = time.perf_counter()
        if rank == 0:
            file_bytes = checkpoint.save(args.run_dir, tr.state(), keep=2).stat().st_size
        step()  # the other ranks wait in this step's exchange for rank 0
        sync.append(time.perf_counter() - t - step_s)
        for _ in range(SETTLE):
            step()

    ckpt = AsyncCheckpointer(args.run_dir, keep=2) if args.writer == "thread" else ForkWriter(args.run_dir, 2)
    stall: list[float] = []
    snapshot: list[float] = []
    steps_in_write: list[tuple[int, float]] = []
    rss0 = rss_bytes()
    peak = PeakRss()
    for _ in range(args.rounds):
        barrier()
        t0 = time.perf_counter()
        if rank == 0:
            ckpt.save(tr.state())
        t1 = time.perf_counter()
        n = 0
        while not step(rank == 0 and ckpt.poll() is not None):  # until rank 0's write is durable
            n += 1
        n += 1
        end = time.perf_counter()
        stall.append(end - t0 - n * step_s)
        snapshot.append(t1 - t0)
        steps_in_write.append((n, end - t1))
        for _ in range(SETTLE):
            step()
    extra = peak.stop() - rss0
    ckpt.close()
    n_all, s_all = sum(n for n, _ in steps_in_write), sum(s for _, s in steps_in_write)
    result: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "step_s": step_s,
        "file_bytes": file_bytes,
        "sync_stall_s": common.summary(sync),
        "async_stall_s": common.summary(stall),
        "snapshot_s": common.summary(snapshot),
        "steps_during_write": n_all,
        "step_slowdown_during_write": (s_all / n_all) / step_s,
        "async_peak_extra_rss_bytes": extra,
    }
    args.out.write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as ddp_slurm.train: finalizing the interpreter can abort a finished gloo rank
