"""Command line of ``python -m ddp_slurm.bench``: one subcommand per benchmark (see each module's doc)."""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys

from ddp_slurm import argtypes
from ddp_slurm.bench import __doc__ as PACKAGE_DOC
from ddp_slurm.exitcodes import EXIT_FAILURE, exit_now
from ddp_slurm.text import plain

# Benchmark modules import torch: only the chosen one is imported, so `--help` answers at once.
# command -> one line of help; the module is ddp_slurm.bench.<MODULES.get(command, command)>.
COMMANDS = {
    "loader": "ddp_slurm's step vs the seed-style torchvision/DataLoader pipeline: samples/s and ratio",
    "limit": "the training step's fraction of this machine's measured matmul FLOP/s",
    "ddp": "weak scaling 1 -> 2 ranks on this machine: efficiency, compute vs communication",
    "startup": "seconds to the first optimizer step of ddp_slurm.train vs import torch alone",
    "tta": "seconds to a target test accuracy on the sample, over seeds",
    "forecast": "inside an allocation: all-reduce alpha-beta and step compute, step time at 1..1024 nodes",
    "checkpoint": "per-checkpoint training stall, synchronous vs asynchronous (checkpoint.async)",
    "memory": "per-rank model-state bytes and peak memory, DDP vs FSDP2 (dist.strategy)",
    "overhead": "the real training loop vs a bare PyTorch loop, same model, data and batch: ratio",
    "shards": "the same samples from shards vs one file each, cold cache, the runtime's loader: ratio",
}
# Named for what they measure, not after the runtime modules they exercise (train/loader.py, train/ddp.py,
# train/checkpoint/), so that no two modules of the package share a name.
MODULES = {
    "loader": "pipeline_speed",
    "ddp": "ddp_scaling",
    "checkpoint": "checkpoint_stall",
    "shards": "shard_reading",
}


def module_of(command: str):
    """The module of a subcommand (imported now: it imports torch)."""
    return importlib.import_module(f"ddp_slurm.bench.{MODULES.get(command, command)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Every flag is checked here (argtypes: bounds, finite numbers, an output file that can be written),
    so a bad one is one line (exit 2) before any benchmark starts."""
    parser = argtypes.OneLineParser(
        prog="python -m ddp_slurm.bench",
        description=plain(PACKAGE_DOC),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    for name, help_text in COMMANDS.items():
        if name != chosen:
            sub.add_parser(name, help=help_text)
            continue
        module = module_of(name)
        from ddp_slurm.bench import flags

        p = sub.add_parser(
            name,
            help=help_text,
            description=plain(module.__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument(
            "--json", type=argtypes.output_file, metavar="FILE", help="also write the figures as JSON to FILE"
        )
        p.add_argument(
            "--threads",
            type=flags.per_cpu(),
            default=None,
            help="torch intra-op threads (default: what ddp_slurm.train would use); for startup and tta "
            "those of the training processes (OMP_NUM_THREADS), for ddp per rank (default: half "
            "the CPUs), for checkpoint per rank (default: 1, which leaves the writer a core at "
            "world size 1, as on a GPU node)",
        )
        module.add_arguments(p)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a time limit, Ctrl-C of a wrapper) unwinds like an exception, so that the child processes
    # a benchmark started are stopped by its ``finally`` blocks instead of being left behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    from ddp_slurm.bench import common

    module = module_of(args.command)
    try:
        threads = args.threads if args.command in ("ddp", "checkpoint") else common.set_threads(args.threads)
        payload = module.measure(args, threads)
    except common.BenchError as exc:
        print(f"ddp_slurm.bench {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # its scratch folder cannot be made (the working directory is read-only, full, ...)
        print(f"ddp_slurm.bench {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if payload is None:  # a rank other than 0 of a multi-rank benchmark, which rank 0 reports
        return 0
    try:
        common.report(payload, module.render(payload), args.json)
    except OSError as exc:  # the disk filled up, or the folder went away, while the benchmark ran
        print(
            f"ddp_slurm.bench {args.command}: error: cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr
        )
        return EXIT_FAILURE
    return 0


if __name__ == "__main__":
    # Leaves without finalizing: forecast and checkpoint run torch.distributed here (see exit_now).
    exit_now(main())
