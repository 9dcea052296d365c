"""``python -m ddp_slurm.data download --root DIR``: fetch full MNIST on a machine with internet.

The command line is read here, before torch is imported (``--help`` answers at once); the download
itself is ``ddp_slurm.tasks.mnist.data.download``.
"""

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_slurm.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download", help="fetch full MNIST (run on a machine with internet, e.g. a login node)")
    dl.add_argument("--root", required=True, type=Path, help="directory to hold MNIST/raw")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from ddp_slurm.tasks.mnist.data import download, one_line

    try:
        download(args.root)
    except Exception as exc:
        print(f"error: could not download MNIST to {args.root}: {one_line(exc)}", file=sys.stderr)
        return 1
    print(f"MNIST ready under {args.root}/MNIST/raw; train with data.source=mnist data.root={args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
