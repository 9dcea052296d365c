"""Command line of ``python -m ddp_slurm.bench``: one subcommand per benchmark (see each module's doc)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from ddp_slurm.bench import __doc__ as PACKAGE_DOC
from ddp_slurm.bench import checkpoint, common, ddp, forecast, limit, loader, startup, tta
from ddp_slurm.exitcodes import EXIT_USAGE

COMMANDS = {
    "loader": (loader, "ddp_slurm's step vs the seed-style torchvision/DataLoader pipeline: samples/s and ratio"),
    "limit": (limit, "the training step's fraction of this machine's measured matmul FLOP/s"),
    "ddp": (ddp, "weak scaling 1 -> 2 ranks on this machine: efficiency, compute vs communication"),
    "startup": (startup, "seconds to the first optimizer step of ddp_slurm.train vs `import torch`"),
    "tta": (tta, "seconds to a target test accuracy on the sample, over seeds"),
    "forecast": (forecast, "inside an allocation: all-reduce alpha-beta and step compute, step time at 1..1024 nodes"),
    "checkpoint": (checkpoint, "per-checkpoint training stall, synchronous vs asynchronous (checkpoint.async)"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_slurm.bench", description=PACKAGE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON to FILE")
        p.add_argument(
            "--threads",
            type=int,
            default=None,
            help="torch intra-op threads (default: what ddp_slurm.train would use); for startup and tta "
            "those of the training processes (OMP_NUM_THREADS), for ddp per rank (default: half "
            "the CPUs)",
        )
        module.add_arguments(p)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a time limit, Ctrl-C of a wrapper) unwinds like an exception, so that the child processes
    # a benchmark started are stopped by its ``finally`` blocks instead of being left behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    module = COMMANDS[args.command][0]
    try:
        if args.threads is not None and args.threads < 1:
            raise common.BenchError(f"--threads {args.threads}: expected an integer >= 1")
        threads = args.threads if args.command == "ddp" else common.set_threads(args.threads)
        payload = module.measure(args, threads)
    except common.BenchError as exc:
        print(f"ddp_slurm.bench {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if payload is not None:  # None: a rank other than 0 of a multi-rank benchmark, which rank 0 reports
        common.report(payload, module.render(payload), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
