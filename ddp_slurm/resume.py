"""``ddp-slurm resume RUN_DIR [KEY=VALUE ...]`` (or ``python -m ddp_slurm.resume``): continue a run with
the settings it was started with.

Why: a run resumes only with the config it was started with (``config.changes_from``), and a
user who started it with six overrides would otherwise have to type them all again. This reads
``RUN_DIR/config.yaml`` (the resolved config the run wrote), points ``run.output_root``/``run.name`` at
``RUN_DIR`` wherever it now lies, applies only the overrides given (those a resume allows: logging,
workers, ``checkpoint.*``, ``dist.*``, ``slurm.*``; anything else is refused by the training as usual)
and trains as ``python -m ddp_slurm.train`` does. It is one rank like that one, so it runs under
torchrun or the local launcher too::

    python -m ddp_slurm.launch --standalone --nproc-per-node 2 -m ddp_slurm.resume runs/two

Nothing here imports torch: a bad RUN_DIR is one line and exit 2 at once. A run directory someone else
could have written (another owner, writable by the group without ``run.shared``, by every user, a
symlink) is refused here, before training imports the task its config.yaml names: that file could be
a co-tenant's code (``safefs.check_run_dir``, with ``run.shared`` read from the saved YAML, no import).
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before torch is imported: a stop signal from here on is a clean stop
    from ddp_slurm.train.signals import StopFlag

    _early = StopFlag.early()

import argparse
import sys
from pathlib import Path

from ddp_slurm import config, safefs
from ddp_slurm.exitcodes import EXIT_USAGE
from ddp_slurm.runpaths import RunPaths

PROG = "ddp-slurm resume"


class _OneLineParser(argparse.ArgumentParser):
    """One line on a usage error, as every entry point (argparse prints its usage block first)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{PROG}: error: {message.replace(', KEY=VALUE', '')} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _OneLineParser(
        prog=PROG,
        description="Continue a run with the config it was started with (RUN_DIR/config.yaml); "
        "KEY=VALUE overrides only what a resume may change (logging, checkpoint.*, dist.*, slurm.*, workers).",
        epilog="Under torchrun or the local launcher: python -m ddp_slurm.launch --standalone "
        "--nproc-per-node 2 -m ddp_slurm.resume RUN_DIR",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory (runs/<name>)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser.parse_args(argv)


def train_argv(run_dir: Path, overrides: list[str]) -> list[str]:
    """The ``python -m ddp_slurm.train`` arguments that resume ``run_dir``; ValueError when it is no run, or
    one that this user may not trust (see the module docstring)."""
    saved = RunPaths(run_dir).config
    if not saved.is_file():
        raise ValueError(
            f"{run_dir} is not a run directory (no config.yaml in it); give runs/<name> of a run that started"
        )
    try:
        shared = config.read_resolved(saved).run.shared  # the runtime's keys only: the task is not imported
        safefs.check_run_dir(run_dir, shared)
    except (config.ConfigError, safefs.UnsafePath) as exc:
        raise ValueError(str(exc)) from None
    parent = run_dir.parent if str(run_dir.parent) else Path(".")
    return ["--config", str(saved), f"run.output_root={parent}", f"run.name={run_dir.name}", *overrides]


def main(argv: list[str] | None = None, stop=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        forwarded = train_argv(Path(args.run_dir), args.overrides)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from ddp_slurm.train import cli

    return cli.main(forwarded, stop=stop)


if __name__ == "__main__":
    sys.exit(main(stop=_early))
