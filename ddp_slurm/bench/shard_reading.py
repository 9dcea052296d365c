"""``bench shards``: the same samples read from shards and map-style, from the same disk, side by side.

The data (``--count`` samples of ``--payload`` seeded random bytes plus an 8-byte label, written into a
fresh folder under ``--dir``): (a) map-style, one file per sample (``files/<i>.bin``), read by a Dataset
that opens and reads one file per sample; (b) the same files written into shards by the runtime's writer
(``ddp_slurm.shards.write``, about ``--per-shard`` samples each; its time is reported) and read through
``ddp_slurm.Shards`` (a batch's neighbours in one shard in one pread, read-ahead hints from the training
process). Both go through the runtime's loader (``train.loader.make_batches``: the step sampler, DataLoader
workers, per-sample seeding, the same decode into tensors) for one epoch (``--samples``: that many), one
global batch of ``--batch`` at a time, in the order each layout trains in.

Before every pass each file of that layout is evicted from the page cache (``POSIX_FADV_DONTNEED``, no
root needed), so a pass reads from the disk. Passes alternate A B A B (``--repeat`` rounds), so a change
in the machine hits both alike. A pass is timed from building the loader to its last batch (worker
start-up included); its workers are stopped at the end of the pass.

Bytes read per sample: ``read_bytes`` of ``/proc/self/io`` across the pass, which counts what the block
layer read for this process and, once they have exited and been reaped, its DataLoader workers: page-cache
misses with the kernel's read-ahead and the file system's metadata blocks. Inodes, directory entries and
directory blocks stay cached (the eviction cannot drop them), so they are read once, not every pass: this
favours map-style, which opens a file per sample. n/a where the kernel does not keep the counter. Disk
reads per sample: the read requests of this process's cgroup (under ``benchmarks/throttled_disk.sh``, which
runs the command alone in one; n/a in the machine's root group, whose counts are everyone's).

``--memory``: also read ``--memory-reads`` samples (default 10^6) of a small shard set (200 shards of 50
samples) through ``Shards.raw`` in this process, in the training order: RSS and the open-file and table
caches after a tenth of them and after all; flat memory means the growth stays near zero.

On a slow disk: ``benchmarks/throttled_disk.sh --read MIB_PER_S DIR -- python -m ddp_slurm.bench shards
--dir DIR`` (the limits found in this process's cgroup are reported).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ddp_slurm import argtypes, config
from ddp_slurm.bench import common, flags
from ddp_slurm.bench import shard_data as sd

MAX_COUNT = 2_000_000  # files written for map-style reading


def add_arguments(p: argparse.ArgumentParser) -> None:
    train = config.load().train
    p.add_argument("--count", type=argtypes.integer(1, MAX_COUNT), default=20_000, help="samples (default 20000)")
    p.add_argument(
        "--payload", type=argtypes.integer(1, 16 << 20), default=4096, help="random bytes per sample (default 4096)"
    )
    p.add_argument("--per-shard", type=argtypes.integer(1, MAX_COUNT), default=1000, help="samples per shard")
    p.add_argument("--batch", type=argtypes.integer(1, MAX_COUNT), default=256, help="global batch (default 256)")
    p.add_argument(
        "--samples", type=argtypes.integer(1, None), default=None, help="samples per pass (default: an epoch)"
    )
    p.add_argument("--repeat", type=flags.count(), default=3, help="A B rounds (default 3)")
    p.add_argument(
        "--workers", type=flags.per_cpu(0), default=train.workers, help=f"DataLoader workers (default {train.workers})"
    )
    p.add_argument("--prefetch", type=argtypes.integer(1, 64), default=train.prefetch, help="batches per worker ahead")
    p.add_argument(
        "--dir",
        type=argtypes.output_dir,
        default=None,
        help="an existing folder on the disk to measure (default: a temporary folder in the working directory)",
    )
    p.add_argument("--memory", action="store_true", help="also measure memory over --memory-reads reads (slow)")
    p.add_argument("--memory-reads", type=argtypes.integer(10, 10**8), default=10**6, help="reads of --memory")


def read_pass(data: Any, files: list[Path], args: argparse.Namespace, steps: int, epoch: int) -> dict[str, Any]:
    """One pass over ``data`` through the runtime's loader from a cold cache: samples, seconds, bytes read."""
    from ddp_slurm.train import loader

    sd.drop_cache(files)
    cfg = SimpleNamespace(workers=args.workers, prefetch=args.prefetch)
    requests, before, start = sd.cgroup_read_requests(), sd.disk_read_bytes(), time.perf_counter()
    batches = loader.make_batches(data, torch.device("cpu"), 0, args.batch, 0, 1, cfg=cfg)
    if steps < batches.steps_per_epoch:  # the runtime's own step filter: steps past the count are not read
        batches.skip = lambda step: (step - 1) % batches.steps_per_epoch >= steps
    count = labels = 0
    try:
        for payload, label in batches.epoch(epoch, 0):
            count += int(label.shape[0])
            labels += int(label.sum())
    finally:
        batches.close()  # its workers exit and are reaped: their reads are in /proc/self/io from now on
    seconds = time.perf_counter() - start
    after = sd.disk_read_bytes()
    read = None if before is None or after is None else after - before
    requests_after = sd.cgroup_read_requests()
    sent = None if requests is None or requests_after is None else requests_after - requests
    return {"samples": count, "seconds": seconds, "label_sum": labels, "disk_read_bytes": read, "disk_reads": sent}


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    if args.batch > args.count:
        raise common.BenchError(f"--batch {args.batch} is more than the --count {args.count} samples")
    base = args.dir or Path.cwd()
    sd.check_space(base, args.count, args.payload)
    folder = Path(tempfile.mkdtemp(prefix=".bench-shards-", dir=base))
    try:
        files_s = sd.write_files(folder / "files", args.count, args.payload, seed=0)
        shards_s, n_shards = sd.write_shards(folder / "files", folder / "shards", args.per_shard)
        from ddp_slurm.shards.dataset import Shards

        files = sd.Files(folder / "files", args.count)
        sides = {
            "map": (files, files.paths()),
            "sharded": (Shards(folder / "shards", sd.decode), sd.shard_paths(folder / "shards")),
        }
        steps = (args.samples or args.count) // args.batch
        if steps == 0:
            raise common.BenchError(f"--samples {args.samples} is less than one --batch of {args.batch}")
        passes: dict[str, list[dict[str, Any]]] = {"map": [], "sharded": []}
        for r in range(args.repeat):
            for name, (data, paths) in sides.items():
                passes[name].append(read_pass(data, paths, args, steps, epoch=r))
        memory = None
        if args.memory:
            memory = sd.memory_flatness(sd.small_shards(folder / "small"), args.memory_reads, 0, args.batch)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return payload_of(args, threads, passes, files_s, shards_s, n_shards, memory)


def payload_of(args, threads, passes, files_s, shards_s, n_shards, memory) -> dict[str, Any]:
    """The JSON: the header, each side's rates and bytes per sample, the ratio."""
    rates = {k: [p["samples"] / p["seconds"] for p in v] for k, v in passes.items()}
    payload = common.header(
        "shards",
        "cpu",
        threads,
        count=args.count,
        payload_bytes=args.payload,
        sample_bytes=args.payload + sd.LABEL,
        shards=n_shards,
        per_shard=args.per_shard,
        batch=args.batch,
        samples_per_pass=passes["map"][0]["samples"],
        repeat=args.repeat,
        workers=args.workers,
        prefetch=args.prefetch,
        dir=str(args.dir) if args.dir else None,
    )
    a, b = common.summary(rates["map"]), common.summary(rates["sharded"])
    payload.update(
        {
            "read_throttle": sd.read_throttle(),
            "write_s": {"files": files_s, "shards": shards_s},
            "map_samples_per_s": a,
            "sharded_samples_per_s": b,
            "ratio": b["median"] / a["median"],
            "ratio_per_round": [y / x for x, y in zip(rates["map"], rates["sharded"])],
            "passes": passes,
        }
    )
    for side in ("map", "sharded"):
        for key, what in (("disk_read_bytes", "disk_bytes_per_sample"), ("disk_reads", "disk_reads_per_sample")):
            per = [p[key] / p["samples"] for p in passes[side] if p[key] is not None]
            payload[f"{side}_{what}"] = common.summary(per) if per else None
    if memory is not None:
        payload["memory"] = memory
    return payload


def render(p: dict[str, Any]) -> str:
    q = p["params"]
    title = (
        f"bench shards: {q['count']:,} samples of {q['sample_bytes']:,} bytes, batch {q['batch']}, "
        f"{q['workers']} worker(s), {q['repeat']} rounds of {q['samples_per_pass']:,} samples, A B A B, cold cache"
    )
    rows = []
    for side, what in (("map", "(a) map-style: one file per sample"), ("sharded", f"(b) Shards: {q['shards']} shards")):
        per, reads = p[f"{side}_disk_bytes_per_sample"], p[f"{side}_disk_reads_per_sample"]
        cells = [common.fmt(per and per["median"]), common.fmt(reads and reads["median"], 2)]
        rows.append([what, *common.fmt_spread(p[f"{side}_samples_per_s"]), *cells])
    notes = [
        f"ratio (b)/(a) of the medians: {p['ratio']:.2f}x  (per round: "
        f"{', '.join(f'{r:.2f}' for r in p['ratio_per_round'])})",
        f"written in {p['write_s']['files']:.1f} s (files) and {p['write_s']['shards']:.1f} s (shards from the files, "
        "indexed)",
        "disk: "
        + ("; ".join(p["read_throttle"]) or "reads not throttled")
        + f"; load average {p['machine']['load_average_1m']}",
    ]
    m = p.get("memory")
    if m:
        first, last = m["marks"][0], m["marks"][-1]
        notes.append(
            f"memory, Shards.raw in one process ({m['shards']} shards, window {m['window']}): RSS "
            f"{first['rss_bytes'] / 2**20:.1f} MiB after {first['reads']:,} reads, {last['rss_bytes'] / 2**20:.1f} MiB "
            f"after {last['reads']:,}; cached fds {first['cached_shard_fds']} -> {last['cached_shard_fds']}, tables "
            f"{first['cached_tables']} -> {last['cached_tables']}, open fds {first['open_fds']} -> {last['open_fds']}"
        )
    headers = ["reading", "samples/s median", "min-max", "spread", "disk bytes/sample", "disk reads/sample"]
    return common.table(title, headers, rows, notes)
