"""Checkpoint cost: how long training stalls per checkpoint, synchronous vs asynchronous (checkpoint.async).

``python -m ddp_slurm.bench checkpoint --state-mb N`` measures, side by side in one run, with N MiB
of synthetic model and optimizer state (16 MiB float32 tensors: weights and Adam's two moments) next
to a small model that trains (``ddp_slurm.bench.ckpt_worker``), at world size 1 and 2 (gloo, rank 0
writes):

- stall per checkpoint: synchronous, the time ``checkpoint.save`` blocks; asynchronous, the copy to
  host memory plus what the background write costs the steps that run beside it (their time minus
  the same number of undisturbed steps, timed right after the write). ``stall_ratio`` = async stall / sync stall (world size 1);
- save throughput: MiB/s of the synchronous save against the disk's own limit: raw sequential writes
  of the same size with fsync, in the same directory, into new files of which the newest two stay (as
  the saves keep theirs), each right before a synchronous save, so that both meet the same disk and
  the same state of the machine's memory (also a raw write that starts the disk writing behind it
  as the save does, for reference);
- signal to durable: SIGUSR2 at the worst moment, until the stop step's checkpoint is on disk:
  asynchronous, right after a save handed its write to the writer and training went on (the stop
  step then supersedes that write: cancelled, and the stop step written); synchronous, as a save
  begins (it finishes, and is the stop step);
- peak extra RSS of asynchronous saving (the host copy), sampled during the saves.

``--device cuda --worlds 1``: the small model, its optimizer and the synthetic state live on the GPU;
a synchronous save copies them to the host inside ``torch.save``, an asynchronous one queues their copy
into pinned host memory (``checkpoint/snapshot.py``'s ``Snapshotter``) and the writer waits for it on events; "copy s" is then
the time until that copy has landed (the step after a save would wait behind it on the stream anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ddp_slurm import argtypes, safefs
from ddp_slurm.bench import common, flags
from ddp_slurm.train.checkpoint import seal as ckpt_seal

SYNC_STEPS_AFTER = 5  # steps between two measured saves, so each starts from a steady state
MAX_WIDTH, MAX_BATCH = 1 << 14, 1 << 16  # of the small model that trains beside the state


def model_bytes(width: int, batch: int) -> int:
    """What the small model of ``ckpt_worker.Trainer`` holds: three layers of about width x width (fp32
    weights, gradients, Adam's two moments) and a batch's activations."""
    return 16 * 3 * width * (width + 1) + 4 * 4 * batch * width


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-mb",
        type=argtypes.number(0, *argtypes.memory_mib(), above=True),
        default=512.0,
        help="MiB of synthetic model+optimizer state",
    )
    p.add_argument("--rounds", type=flags.count(), default=5, help="checkpoints measured per mode and world size")
    p.add_argument("--worlds", type=flags.world_sizes(), default="1,2", help="world sizes to measure, comma-separated")
    p.add_argument(
        "--width",
        type=argtypes.integer(1, MAX_WIDTH),
        default=256,
        help="width of the small model that trains (step time)",
    )
    p.add_argument("--batch", type=argtypes.integer(1, MAX_BATCH), default=64)
    p.add_argument(
        "--dir",
        type=argtypes.output_dir,
        default=None,
        help="an existing folder to write in (default: a temporary folder in the working directory)",
    )
    p.add_argument("--timeout", type=flags.seconds(), default=1800.0, help="seconds before a worker is given up")
    p.add_argument(
        "--strategy",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="fsdp: sharded checkpoints of an FSDP2 model, async against sync (bench/checkpoint_fsdp.py)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model and state live; cuda: on the GPU, saved through pinned host memory, world size 1",
    )


# ---------------------------------------------------------------- the disk's own limit


KEEP = 2  # checkpoints kept while the saves are measured; the raw-write baseline keeps as many files


def raw_write_s(folder: Path, nbytes: int, index: int, write_behind: bool = False) -> float:
    """Seconds for one sequential write of ``nbytes`` (8 MiB writes) with fsync, as a checkpoint is
    written: into a new file ``raw-<index>.bin``, its pages then dropped from the cache
    (``safefs.write_atomic`` does the same); the file ``KEEP`` writes older is deleted, so as many stay
    as the measured saves keep. ``write_behind``: also start the disk writing every
    ``ckpt_seal.SLICE`` bytes, as a save does (a plain write leaves it all to the fsync)."""
    chunk = os.urandom(8 << 20)
    start = time.perf_counter()
    fd = os.open(folder / f"raw-{index}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = behind = 0
        while written < nbytes:
            written += os.write(fd, chunk[: min(nbytes - written, len(chunk))])
            if write_behind and written - behind >= ckpt_seal.SLICE:
                safefs.drop_cache(fd, behind, written - behind)
                behind = written
        os.fsync(fd)
        safefs.drop_cache(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    (folder / f"raw-{index - KEEP}.bin").unlink(missing_ok=True)
    return seconds


# ---------------------------------------------------------------- the workers


def launch_measure(
    args: argparse.Namespace, world: int, threads: int, folder: Path, writer: str | None = None
) -> dict[str, Any]:
    """Run the measuring worker at ``world`` ranks (``writer``: checkpoint.wholefile_writer's default when None); rank 0's figures."""
    tag = f"w{world}-{writer or 'default'}"

    def command(out: Path) -> list[str]:
        cmd = [sys.executable, "-m", "ddp_slurm.bench.ckpt_measure", "--out", str(out)]
        cmd += ["--run-dir", str(folder / tag), "--state-mb", str(args.state_mb), "--rounds", str(args.rounds)]
        cmd += ["--width", str(args.width), "--batch", str(args.batch), "--device", args.device]
        return cmd + (["--writer", writer] if writer else [])

    outs = common.run_local_ranks("checkpoint", world, threads, folder, tag, args.timeout, command)
    shutil.rmtree(folder / tag, ignore_errors=True)
    return json.loads(outs[0].read_text())


def signal_to_durable(args: argparse.Namespace, threads: int, folder: Path, mode: str) -> dict[str, Any]:
    """SIGUSR2 as the step-40 save begins (sync) or right after it handed its write over (async); seconds
    until the stop step's checkpoint is durable, and until the process has exited."""
    run_dir = folder / f"signal-{mode}"
    cmd = [sys.executable, "-m", "ddp_slurm.bench.ckpt_worker", "--run-dir", str(run_dir), "--mode", mode]
    cmd += ["--state-mb", str(args.state_mb), "--steps", "100000", "--every", "20"]
    cmd += ["--width", str(args.width), "--batch", str(args.batch), "--device", args.device]
    proc = subprocess.Popen(cmd, env=common.child_env(OMP_NUM_THREADS=str(threads)), stdout=subprocess.PIPE, text=True)
    events: list[dict[str, Any]] = []
    timer = threading.Timer(args.timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        sent = None
        for line in proc.stdout:
            event = json.loads(line)
            events.append(event)
            if event["event"] == ("handed" if mode == "async" else "begin") and event["step"] == 40 and sent is None:
                sent = time.monotonic()
                proc.send_signal(signal.SIGUSR2)
        code = proc.wait()
        exited = time.monotonic()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(run_dir, ignore_errors=True)
    stopped = [e["step"] for e in events if e["event"] == "stopped"]
    if code != 75 or not stopped or sent is None:
        raise common.BenchError(f"signal-to-durable run ({mode}) ended with exit {code}, events {events[-3:]}")
    durable = max(e["t"] for e in events if e["event"] == "durable" and e["step"] == stopped[0])
    return {"signal_to_durable_s": durable - sent, "signal_to_exit_s": exited - sent, "stop_step": stopped[0]}


# ---------------------------------------------------------------- the command


def measure(args: argparse.Namespace, threads: int | None) -> dict[str, Any]:
    threads = threads or 1  # per rank: --threads, else one
    worlds = sorted(set(args.worlds))
    shown = ",".join(map(str, worlds))
    # Every rank holds the whole state (sharded: its share), and the small model; the asynchronous
    # copies have the other half of what check_memory allows.
    holders = 1 if args.strategy == "fsdp" else worlds[-1]
    flags.check_memory(
        f"--state-mb {args.state_mb:g} --width {args.width} --batch {args.batch} at world size {worlds[-1]}",
        holders * args.state_mb * 2**20 + worlds[-1] * model_bytes(args.width, args.batch),
    )
    if args.device == "cuda":
        if args.strategy == "fsdp":
            raise common.BenchError("--strategy fsdp measures on CPU ranks (gloo): leave out --device cuda")
        common.resolve_device("cuda")  # BenchError without a GPU
        if worlds != [1]:
            raise common.BenchError(f"--device cuda measures world size 1 (one GPU): add --worlds 1, not {shown}")
    if args.strategy == "fsdp":
        from ddp_slurm.bench import checkpoint_fsdp

        return checkpoint_fsdp.measure(args, threads, worlds)
    base = args.dir or Path.cwd()
    folder = Path(tempfile.mkdtemp(prefix=".bench-checkpoint-", dir=base))
    try:
        by_world = {str(w): launch_measure(args, w, threads, folder) for w in worlds}
        other = "thread" if by_world[str(worlds[0])]["writer"] == "process" else "process"
        # the other writer at the first world size, for the choice between them (checkpoint/wholefile_writer.py's docstring)
        writers = {by_world[str(worlds[0])]["writer"]: by_world[str(worlds[0])]}
        if args.device == "cpu":  # the process writer forks: a process holding CUDA state is not one to fork
            writers[other] = launch_measure(args, worlds[0], threads, folder, other)
        signals = {mode: signal_to_durable(args, threads, folder, mode) for mode in ("sync", "async")}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    first = by_world[str(worlds[0])]
    raw_s, behind_s = first["raw_write_s"]["median"], first["raw_write_behind_s"]["median"]
    mib = first["file_bytes"] / 2**20
    payload = common.header(
        "checkpoint", args.device, threads, state_mb=args.state_mb, rounds=args.rounds, worlds=worlds, width=args.width
    )
    payload.update(
        {
            "directory": str(base),
            "raw_write_s": first["raw_write_s"],
            "raw_write_mib_s": args.state_mb / raw_s,
            "raw_write_behind_s": first["raw_write_behind_s"],
            "worlds": by_world,
            "writers": writers,
            "sync_stall_s": first["sync_stall_s"]["median"],
            "async_stall_s": first["async_stall_s"]["median"],
            "stall_ratio": first["async_stall_s"]["median"] / first["sync_stall_s"]["median"],
            "sync_save_mib_s": mib / first["sync_stall_s"]["median"],
            "save_vs_raw": (mib / first["sync_stall_s"]["median"]) / (args.state_mb / raw_s),
            "save_vs_raw_write_behind": behind_s / first["sync_stall_s"]["median"] * mib / args.state_mb,
            "signal": signals,
            "signal_budget_s": raw_s + 2.0,
            "async_peak_extra_rss_mib": first["async_peak_extra_rss_bytes"] / 2**20,
        }
    )
    return payload


def render(p: dict[str, Any]) -> str:
    if p.get("strategy") == "fsdp":
        from ddp_slurm.bench import checkpoint_fsdp

        return checkpoint_fsdp.render(p)
    rows = []
    runs = [(f"world size {w}, {r['writer']}", r) for w, r in p["worlds"].items()]
    runs += [
        (f"world size {r['world']}, {name}", r) for name, r in p["writers"].items() if r not in p["worlds"].values()
    ]
    for label, r in runs:
        rows.append(
            [
                label,
                common.fmt(r["step_s"] * 1e3, 1),
                common.fmt(r["sync_stall_s"]["median"], 3),
                common.fmt(r["async_stall_s"]["median"], 3),
                common.fmt(r["snapshot_s"]["median"], 3),
                f"{r['async_stall_s']['median'] / r['sync_stall_s']['median']:.3f}",
                f"{r['step_slowdown_during_write']:.2f}x",
                common.fmt(r["async_peak_extra_rss_bytes"] / 2**20),
            ]
        )
    sig = p["signal"]
    notes = [
        f"disk: raw sequential write + fsync of {p['params']['state_mb']:g} MiB: {p['raw_write_s']['median']:.2f} s "
        f"({p['raw_write_mib_s']:,.0f} MiB/s); synchronous save {p['sync_save_mib_s']:,.0f} MiB/s = "
        f"{100 * p['save_vs_raw']:.0f}% of it (a raw write that also writes behind, as the save does: "
        f"{p['raw_write_behind_s']['median']:.2f} s; the save is {100 * p['save_vs_raw_write_behind']:.0f}% of it)",
        f"signal to durable stop checkpoint: async {sig['async']['signal_to_durable_s']:.2f} s, sync "
        f"{sig['sync']['signal_to_durable_s']:.2f} s (budget: raw write + 2 s = {p['signal_budget_s']:.2f} s)",
        "the first asynchronous save also allocates the host buffers the others reuse (not in the medians): "
        + ", ".join(
            f"{label}: copy {r['first_snapshot_s']:.3f} s, stall {r['first_async_stall_s']:.3f} s" for label, r in runs
        ),
        f"stall_ratio (world size 1) = {p['stall_ratio']:.3f}",
    ]
    return common.table(
        f"checkpoint stall, {p['params']['state_mb']:g} MiB of state on {p['device']}, in {p['directory']}",
        ["", "step ms", "sync stall s", "async stall s", "copy s", "ratio", "step slowdown", "extra RSS MiB"],
        rows,
        notes,
    )
