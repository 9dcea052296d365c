"""Research script: the same shards read by ``ddp_slurm.Shards`` and by the ``webdataset`` library.

Not part of the package and not needed by its tests: ``webdataset`` is installed only where this runs
(``pip install webdataset``, or ``--site DIR``: a folder it was installed into with ``pip install --target``).

    python benchmarks/loader_compare.py --dir DIR [--count 20000] [--workers 2] [--batch 256] [--repeat 3]

It writes the data of ``python -m ddp_slurm.bench shards`` (``--count`` samples of 4 KiB and a label, one
file each, then shards through ``ddp_slurm.shards.write``) into a fresh folder under ``--dir``, then
alternates, each from a cold page cache (``POSIX_FADV_DONTNEED`` on every shard and index file):

(a) ``ddp_slurm.Shards`` through the runtime's loader (``train.loader.make_batches``: samples addressed by
    position, windows of shards shuffled, neighbours read in one pread, read-ahead hints);
(b) ``webdataset.WebDataset`` (shards shuffled, each read start to end as a tar stream, split among the
    workers, a 1,000-sample shuffle buffer) batched and loaded by ``webdataset.WebLoader`` with the same
    worker count and the same decode.

Both read every sample once per pass (checked: the count and the sum of labels). It prints samples/s
for each, the ratio (a)/(b), and disk bytes read per sample (``/proc/self/io`` ``read_bytes`` over the
pass, workers included once reaped). Under ``benchmarks/throttled_disk.sh --read`` it runs on a slow disk.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def webdataset_pass(wds, shards: list[Path], args: argparse.Namespace, epoch: int, decode) -> tuple[int, int]:
    """One epoch of the shards through webdataset: (samples, sum of labels)."""
    import torch

    dataset = (
        wds.WebDataset([str(p) for p in shards], shardshuffle=len(shards), seed=epoch, empty_check=False)
        .shuffle(1000)
        .map(lambda sample: decode({"bin": sample["bin"]}))
        .batched(args.batch, collation_fn=lambda items: tuple(torch.stack(t) for t in zip(*items)))
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=args.workers)
    count = labels = 0
    for _, label in loader:
        count += int(label.shape[0])
        labels += int(label.sum())
    del loader  # its workers exit (and are reaped) with its iterator
    return count, labels


def shards_pass(data, args: argparse.Namespace, epoch: int) -> tuple[int, int]:
    """One epoch through ddp_slurm's loader (every full global batch): (samples, sum of labels)."""
    import torch

    from ddp_slurm.train import loader

    cfg = SimpleNamespace(workers=args.workers, prefetch=2)
    batches = loader.make_batches(data, torch.device("cpu"), 0, args.batch, 0, 1, cfg=cfg)
    count = labels = 0
    try:
        for _, label in batches.epoch(epoch, 0):
            count += int(label.shape[0])
            labels += int(label.sum())
    finally:
        batches.close()
    return count, labels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path.cwd())
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--site", type=Path, default=None, help="a folder webdataset was installed into")
    args = parser.parse_args()
    if args.site:
        sys.path.append(str(args.site))
    try:
        import webdataset as wds
    except ImportError:
        print("loader_compare.py: needs webdataset (pip install webdataset, or --site DIR)", file=sys.stderr)
        return 2
    from ddp_slurm.bench import shard_data as sd
    from ddp_slurm.shards.dataset import Shards

    folder = Path(tempfile.mkdtemp(prefix=".loader-compare-", dir=args.dir))
    try:
        sd.write_files(folder / "files", args.count, 4096, seed=0)
        sd.write_shards(folder / "files", folder / "shards", args.per_shard)
        shutil.rmtree(folder / "files")
        data = Shards(folder / "shards", sd.decode)
        paths, tars = sd.shard_paths(folder / "shards"), sorted((folder / "shards").glob("*.tar"))
        rates: dict[str, list[float]] = {"ddp_slurm": [], "webdataset": []}
        per_sample: dict[str, list[float]] = {"ddp_slurm": [], "webdataset": []}
        full = args.count // args.batch * args.batch
        for r in range(args.repeat):
            for name in rates:
                sd.drop_cache(paths)
                before, start = sd.disk_read_bytes() or 0, time.perf_counter()
                if name == "ddp_slurm":
                    count, labels = shards_pass(data, args, r)
                else:
                    count, labels = webdataset_pass(wds, tars, args, r, sd.decode)
                seconds = time.perf_counter() - start
                read = (sd.disk_read_bytes() or 0) - before
                if name == "webdataset" and (count != args.count or labels != args.count * (args.count - 1) // 2):
                    raise SystemExit(f"webdataset read {count} samples (label sum {labels}), not all {args.count}")
                if name == "ddp_slurm" and count != full:
                    raise SystemExit(f"ddp_slurm read {count} samples, not {full}")
                rates[name].append(count / seconds)
                per_sample[name].append(read / count)
                print(f"round {r + 1} {name:10s} {count / seconds:10,.0f} samples/s {read / count:8,.0f} B/sample")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    a, b = statistics.median(rates["ddp_slurm"]), statistics.median(rates["webdataset"])
    print(f"median: ddp_slurm {a:,.0f}, webdataset {b:,.0f} samples/s; ratio ddp_slurm/webdataset {a / b:.2f}x")
    print(
        f"disk bytes/sample (median): ddp_slurm {statistics.median(per_sample['ddp_slurm']):,.0f}, "
        f"webdataset {statistics.median(per_sample['webdataset']):,.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
