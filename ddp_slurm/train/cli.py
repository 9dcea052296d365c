"""Command line of ``python -m ddp_slurm.train``, read before torch is imported, and read once.

``--help``, ``--version``, ``--print-config`` and bad arguments answer in a fraction of a second;
only a real training run imports torch (``ddp_slurm.train.entry``, which takes the parsed values and
never sees the command line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddp_slurm import __version__
from ddp_slurm.exitcodes import EXIT_OK, EXIT_USAGE, exit_now
from ddp_slurm.train.signals import StopFlag

PROG = "python -m ddp_slurm.train"


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints its usage block before a bad flag's error; every rank of a big job would repeat it."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"ddp_slurm.train: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _OneLineParser(
        prog=PROG,
        description="Train one rank of a DDP run (or all of a 1-rank one).",
        epilog="KEY=VALUE overrides are dotted config keys, e.g. train.epochs=3; "
        "--print-config --explain lists every key with its meaning.",
    )
    parser.add_argument("--config", type=Path, help="YAML job config (default: the bundled-sample defaults)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit (trains nothing)"
    )
    parser.add_argument(
        "--explain", action="store_true", help="with --print-config: a comment above each key saying what it means"
    )
    parser.add_argument("--version", action="version", version=f"ddp_slurm {__version__}")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser.parse_args(argv)


def print_config(argv: argparse.Namespace) -> int:
    """``--print-config``: the config the run would use, or the one-line error (exit 2)."""
    from ddp_slurm import config
    from ddp_slurm.config import doc

    try:
        cfg = config.load(argv.config, argv.overrides)
    except config.ConfigError as exc:
        print(f"ddp_slurm.train: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(doc.render(cfg, explain=argv.explain))
    return EXIT_OK


def run(argv: list[str] | None = None, stop: StopFlag | None = None, task: type | None = None) -> int:
    """Parse once, then either print the config or train (importing torch only then); returns the exit
    code and never exits (the submitit job calls it). ``stop``: a StopFlag the caller installed (see
    ``entry.train``); ``task``: a Task class given from Python."""
    args = parse_args(argv)
    if args.print_config or args.explain:
        return print_config(args)
    from ddp_slurm.train import entry

    return entry.train(args.config, args.overrides, stop=stop, task=task)


def main(argv: list[str] | None = None, stop: StopFlag | None = None) -> int:
    """``python -m ddp_slurm.train``: ``run``, then leave the process. ``stop``: the flag the entry point
    installed as its first instruction (``StopFlag.early``)."""
    args = parse_args(argv)
    if args.print_config or args.explain:
        return print_config(args)
    from ddp_slurm import exits
    from ddp_slurm.train import entry

    exits.started()  # under the local launcher: how it tells a clean stop from a killed worker
    code = entry.train(args.config, args.overrides, stop=stop)
    if stop is not None:
        stop.close()  # main leaves a flag it was given to its caller (see signals.py on close())
    exits.record(code)
    exit_now(code)  # leaves the process (see exitcodes.exit_now)
    return EXIT_OK  # not reached


if __name__ == "__main__":
    sys.exit(main())
