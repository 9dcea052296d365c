"""``python -m ddp_slurm.data``: get data ready before a job (``download``, ``index``, ``write``).

- ``download --root DIR``: full MNIST, on a machine with internet (``ddp_slurm.tasks.mnist.data.download``);
- ``index DIR``: the index of a folder of WebDataset tar shards, beside them (``ddp_slurm.shards.index``);
- ``write SRC --out DIR``: shards from a folder, a JSONL list or a task's data, then indexed
  (``ddp_slurm.shards.write``).

The command line is read here, before torch is imported (``--help`` answers at once).
"""

import argparse
import logging
import sys
from pathlib import Path

from ddp_slurm import errors


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddp_slurm.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download", help="fetch full MNIST (run on a machine with internet, e.g. a login node)")
    dl.add_argument("--root", required=True, type=Path, help="directory to hold MNIST/raw")
    ix = sub.add_parser("index", help="index a folder of WebDataset tar shards (once, before training on them)")
    ix.add_argument("folder", type=Path, help="the folder of .tar shards; the index goes to FOLDER/.ddp-slurm-index")
    wr = sub.add_parser("write", help="write shards (deterministic) from a folder, a JSONL list or a task's data")
    wr.add_argument("source", help="a folder of <key>.<ext> files, a .jsonl list, or task=module:Class")
    wr.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for a task= source")
    wr.add_argument("--out", required=True, type=Path, help="a new or empty folder for the shards")
    size = wr.add_mutually_exclusive_group()
    size.add_argument("--shards", type=int, help="how many shards (default: --samples-per-shard decides)")
    size.add_argument("--samples-per-shard", type=int, default=1000, help="samples in a shard (default 1000)")
    wr.add_argument("--seed", type=int, default=0, help="the shuffle across shards (default 0)")
    wr.add_argument("--split", choices=("train", "eval"), default="train", help="a task's train_data or eval_data")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.command == "download":
        return _download(args.root)
    try:
        if args.command == "index":
            from ddp_slurm.shards import index

            done = index.build(args.folder)
        else:
            from ddp_slurm.shards import write

            done = write.write(
                args.source,
                args.out,
                args.overrides,
                shards=args.shards,
                per_shard=args.samples_per_shard,
                seed=args.seed,
                split=args.split,
            )
    except errors.Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"indexed {done['samples']} samples in {done['shards']} shards under {done['folder']}")
    return 0


def _download(root: Path) -> int:
    from ddp_slurm.tasks.mnist.data import download, one_line

    try:
        download(root)
    except Exception as exc:
        print(f"error: could not download MNIST to {root}: {one_line(exc)}", file=sys.stderr)
        return 1
    print(f"MNIST ready under {root}/MNIST/raw; train with data.source=mnist data.root={root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
