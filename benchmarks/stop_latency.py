"""How fast a stop signal becomes a checkpoint and an exit, and what a resume loses. Real processes.

    python benchmarks/stop_latency.py                     # the default config (cnn, bundled sample), 1 process
    python benchmarks/stop_latency.py --nproc 2           # 2 ranks through torchrun; the signal goes to rank 1
    python benchmarks/stop_latency.py --repeats 5 train.global_batch_size=256   # any training override

One run directory, stopped ``--repeats`` times: each launch trains ``--after`` steps past where it
started, gets SIGUSR2 (on the last rank only), and the script polls every millisecond for the stop's
checkpoint file (``os.replace`` makes it appear whole) and for each process's exit. The next launch
measures the resume (the step it resumed from, the time until its first step) and is the next stop.
``train.log_every_steps=1`` is added so the step reached when the signal was sent is known.

Reported per stop: the step when the signal was sent and where the ranks stopped (steps run after
the signal), signal -> checkpoint on disk, signal -> last rank exited, signal -> launcher exited,
the resume step (steps lost = stop step - resume step), what a SIGKILL at the same moment would
have lost (steps since the newest periodic or epoch-end checkpoint), and the relaunch's start-up time until its
first training step. The machine's load average is printed too: on a shared machine all of these
are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUN_NAME = "stop-latency"


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def catches(pid: int, sig: int) -> bool:
    """The process has a handler for ``sig`` (SigCgt in /proc/<pid>/status): sending it is safe."""
    try:
        mask = re.search(r"^SigCgt:\s*([0-9a-f]+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return False
    return bool(mask and int(mask[1], 16) >> (sig - 1) & 1)


def rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=", 1)[1])


def gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def last_periodic_checkpoint(run_dir: Path, step: int) -> int:
    """The newest checkpoint at or before ``step`` that a run never stopped by a signal would have:
    every ``checkpoint.every_steps`` and at each epoch end. What a SIGKILL would fall back to."""
    from ddp_slurm import config
    from ddp_slurm.tasks.mnist import data
    from ddp_slurm.train import loader

    cfg = config.read_resolved(run_dir / "config.yaml")
    every = cfg.checkpoint.every_steps
    per_epoch = loader.steps_per_epoch(data.TRAIN_SIZES[cfg.data.source], cfg.train.global_batch_size)
    return max((k for k in range(1, step + 1) if (every and k % every == 0) or k % per_epoch == 0), default=0)


class Stop:
    """One launch: wait for training, signal, time the checkpoint and the exits."""

    def __init__(self, cwd: Path, nproc: int, overrides: list[str], index: int) -> None:
        self.cwd, self.nproc = cwd, nproc
        self.run_dir = cwd / "runs" / RUN_NAME
        self.first_row = len(rows(self.run_dir))
        cmd = [sys.executable, "-m", "ddp_slurm.train"]
        if nproc > 1:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(nproc),
                "-m",
                "ddp_slurm.train",
            ]
        self.log = cwd / f"launch-{index}.log"
        self.t_launch = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd + overrides, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def my_rows(self) -> list[dict[str, Any]]:
        return rows(self.run_dir)[self.first_row :]

    def wait(self, what: str, ready, timeout_s: float = 1800) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc.poll() is not None:
                sys.exit(f"launch exited {self.proc.returncode} before {what}; log: {self.log}")
            if time.monotonic() > deadline:
                sys.exit(f"timed out waiting for {what}; log: {self.log}")
            time.sleep(0.001)

    def workers(self) -> dict[int, int]:
        if self.nproc == 1:
            return {0: self.proc.pid}
        self.wait("the workers", lambda: len(children(self.proc.pid)) == self.nproc)
        kids = children(self.proc.pid)
        self.wait(
            "the workers' environment", lambda: all(b"RANK=" in Path(f"/proc/{k}/environ").read_bytes() for k in kids)
        )
        return {rank_of(k): k for k in kids}

    def run(self, after: int) -> dict[str, Any]:
        ranks = self.workers()
        self.wait("the stop handlers", lambda: all(catches(p, signal.SIGUSR2) for p in ranks.values()))
        self.wait("the start line", lambda: any(r["kind"] == "start" for r in self.my_rows()))
        start = next(r for r in self.my_rows() if r["kind"] == "start")
        t_start_row = time.monotonic()
        first_step: list[float] = []

        def trained(n: int) -> bool:
            steps = [r["step"] for r in self.my_rows() if r["kind"] == "train"]
            if steps and not first_step:
                first_step.append(time.monotonic())
            return bool(steps) and steps[-1] >= start["step"] + n

        self.wait(f"{after} steps", lambda: trained(after))
        step_at_signal = [r["step"] for r in self.my_rows() if r["kind"] == "train"][-1]
        folder = self.run_dir / "checkpoints"
        listing = lambda: [p.name for p in folder.iterdir()] if folder.is_dir() else []  # noqa: E731
        before = set(listing())
        os.kill(ranks[self.nproc - 1], signal.SIGUSR2)
        t0 = time.monotonic()
        appeared: dict[str, float] = {}
        exited: dict[int, float] = {}
        while self.proc.poll() is None or len(exited) < len(ranks):
            now = time.monotonic()
            for name in listing():
                if name.startswith("step-") and name not in before and name not in appeared:
                    appeared[name] = now
            for rank, pid in ranks.items():
                if rank not in exited and gone(pid):
                    exited[rank] = now
            if now - t0 > 600:
                sys.exit(f"no exit 10 minutes after the signal; log: {self.log}")
            time.sleep(0.001)
        t_launcher = time.monotonic()
        stop = next((r for r in self.my_rows() if r["kind"] == "stop"), None)
        if stop is None:
            sys.exit(f"the launch exited {self.proc.returncode} without a stop line; log: {self.log}")
        name = f"step-{stop['step']}.pt"
        return {
            "resumed_from": start["step"] if start["resumed"] else None,
            "startup_to_first_step_s": (first_step[0] if first_step else t_start_row) - self.t_launch,
            "step_at_signal": step_at_signal,
            "stop_step": stop["step"],
            "lost_if_killed_steps": step_at_signal - last_periodic_checkpoint(self.run_dir, step_at_signal),
            "signal_to_checkpoint_s": appeared[name] - t0 if name in appeared else 0.0,  # 0: already on disk
            "signal_to_last_rank_exit_s": max(exited.values()) - t0,
            "signal_to_launcher_exit_s": t_launcher - t0,
            "exit_code": self.proc.returncode,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=1, help="ranks (1: plain python, more: torchrun)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="stops to measure (one more launch measures the last resume)"
    )
    parser.add_argument("--after", type=int, default=15, help="steps each launch trains before its signal")
    parser.add_argument("--keep", action="store_true", help="keep the run directory and logs")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="training config overrides")
    args = parser.parse_args(argv)

    cwd = Path(tempfile.mkdtemp(prefix="stop-latency-"))
    overrides = [*args.overrides, f"run.name={RUN_NAME}", "train.log_every_steps=1"]
    results = []
    try:
        for i in range(args.repeats):
            results.append(Stop(cwd, args.nproc, overrides, i).run(args.after))
        resume = Stop(cwd, args.nproc, overrides, args.repeats)  # measures the last resume, then stops too
        last = resume.run(1)
    finally:
        if not args.keep:
            shutil.rmtree(cwd, ignore_errors=True)
    for i, r in enumerate(results):
        r["resume_step"] = (results[i + 1] if i + 1 < len(results) else last)["resumed_from"]
        r["steps_lost_on_resume"] = r["stop_step"] - r["resume_step"]
        r["relaunch_to_first_step_s"] = (results[i + 1] if i + 1 < len(results) else last)["startup_to_first_step_s"]

    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(
        f"ddp_slurm stop latency: {args.nproc} process(es), overrides {' '.join(overrides)}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs" + (f"; kept in {cwd}" if args.keep else "")
    )
    cols = [
        ("step_at_signal", "signal@step", "{}"),
        ("stop_step", "stop step", "{}"),
        ("signal_to_checkpoint_s", "->ckpt s", "{:.3f}"),
        ("signal_to_last_rank_exit_s", "->rank exit s", "{:.2f}"),
        ("signal_to_launcher_exit_s", "->launcher exit s", "{:.2f}"),
        ("exit_code", "exit", "{}"),
        ("resume_step", "resumed at", "{}"),
        ("steps_lost_on_resume", "steps lost", "{}"),
        ("lost_if_killed_steps", "lost if SIGKILLed", "{}"),
        ("relaunch_to_first_step_s", "relaunch->1st step s", "{:.1f}"),
    ]
    print("  ".join(f"{title:>{max(len(title), 8)}}" for _, title, _ in cols))
    for r in results:
        print("  ".join(f"{fmt.format(r[key]):>{max(len(title), 8)}}" for key, title, fmt in cols))
    timed = [key for key, _, _ in cols if key.endswith("_s")]
    print("median: " + ", ".join(f"{key} {statistics.median(r[key] for r in results):.3f}" for key in timed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
