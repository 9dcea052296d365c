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

Run as a plain process, it keeps the world size the run last trained at (the last ``start`` line of its
metrics.jsonl): a run of 2 local ranks comes back as 2 ranks under the local launcher, bit-identical to
the run left alone; ``--nproc-per-node N`` chooses another (1: this process alone). A run last trained
inside a Slurm job is not brought back as that many local processes: resubmit it, or say how many.

``--step N`` resumes from the checkpoint of step N: the newer ones are set aside first, never deleted
(``train/rewind.py``), in the plain process before any rank starts.

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
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from ddp_slurm import config, errors, safefs
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.exitcodes import EXIT_OK, EXIT_USAGE
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.tools import history

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
    parser.add_argument(
        "--nproc-per-node",
        type=_ranks,
        metavar="N",
        help="local ranks to resume with (default: the world size the run last trained at, on this machine)",
    )
    parser.add_argument(
        "--step",
        type=_step,
        metavar="N",
        help="resume from the checkpoint of step N: the newer ones are moved (never deleted) into "
        "RUN_DIR/set-aside/<time>-after-step-N/, and the line says so",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    # intermixed: overrides may come after the options too (docs/guard.md's `resume RUN --step N guard.skip=A-B`)
    return parser.parse_intermixed_args(argv)


MAX_LOCAL_RANKS = 1024
"""More local processes than this is no resume of anything this machine ran."""


def _ranks(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_LOCAL_RANKS:
        raise argparse.ArgumentTypeError(f"expected a count of ranks from 1 to {MAX_LOCAL_RANKS}, got {text!r}")
    return int(text)


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a step (an integer >= 0), got {text!r}")
    return int(text)


def one_rank_of_a_launch(environ: Mapping[str, str]) -> bool:
    """This process is already one rank of a launch (torchrun, the local launcher, a Slurm step)."""
    try:
        return DistEnv.from_environ(environ).launcher != "single"
    except errors.Error:  # contradictory launcher variables: the training says what is wrong
        return True


def world_size(run_dir: Path, asked: int | None) -> int:
    """The local ranks to resume ``run_dir`` with: ``asked``, else the world size of its last launch (1 when it
    never started one). ValueError for a run last trained inside a Slurm job at more than one rank."""
    if asked is not None:
        return asked
    try:
        starts = history.read_history(run_dir).starts
    except history.ReportError:  # no metrics yet: it never trained a step
        return 1
    if not starts:
        return 1
    last = starts[-1]
    size = last.get("world_size") or 1  # an int: history checks the field's type
    if size > 1 and last.get("job_id"):
        raise ValueError(
            f"{run_dir} last trained at world size {size} in a Slurm job: resubmit it to resume at that size "
            "(docs/cluster.md), or pass --nproc-per-node N to resume it here with N local ranks"
        )
    if not 1 <= size <= MAX_LOCAL_RANKS:
        raise ValueError(f"{run_dir}: its metrics.jsonl says world size {size}; pass --nproc-per-node N")
    return size


def finished_at(run_dir: Path) -> int | None:
    """The step ``run_dir`` finished at, when the newest checkpoint a resume would take says it finished; None
    otherwise, or when that cannot be told here (the ranks then say what is wrong). Reads the checkpoint
    through the gate, as a resume does (torch is imported: the launch this spares would import it too)."""
    from ddp_slurm.train.checkpoint import gate

    try:
        cfg = config.read_resolved(RunPaths(run_dir).config)
        paths = RunPaths(run_dir, cfg.run.shared)
        found = gate.Gate(gate.backend_of(paths), paths, [gate.same_config(cfg)]).newest()
    except (errors.Error, OSError, ValueError):
        return None
    return found[1]["step"] if found is not None and found[1].get("finished") else None


def launcher_argv(run_dir: Path, ranks: int, overrides: list[str]) -> list[str]:
    """The local launcher running this command as ``ranks`` ranks."""
    return [
        sys.executable,
        "-m",
        "ddp_slurm.launch",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "-m",
        "ddp_slurm.resume",
        str(run_dir),
        *overrides,
    ]


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
    run_dir = Path(args.run_dir)
    try:
        forwarded = train_argv(run_dir, args.overrides)
        if one_rank_of_a_launch(os.environ):
            for flag, given in (("--nproc-per-node", args.nproc_per_node), ("--step", args.step)):
                if given is not None:
                    raise ValueError(
                        f"{flag}: this process is already one rank of a launch (torchrun, srun, the local "
                        "launcher); drop the flag, or give it to a plain `ddp-slurm resume` before launching"
                    )
            ranks = 1
        else:
            ranks = world_size(run_dir, args.nproc_per_node)
        if args.step is not None:
            from ddp_slurm.train import rewind

            sys.stderr.write(f"{PROG}: {rewind.rewind(run_dir, args.step)}\n")
    except (ValueError, errors.UsageError) as exc:  # history.ReportError and the rewind's are UsageErrors
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return EXIT_USAGE
    if ranks > 1 and not args.overrides and args.step is None:
        done = finished_at(run_dir)
        if done is not None:  # nothing to train: no ranks, no rendezvous, only to say so
            sys.stderr.write(f"{PROG}: run {run_dir} already finished at step {done}; nothing to do\n")
            return EXIT_OK
    if ranks > 1:
        argv = launcher_argv(run_dir, ranks, args.overrides)
        sys.stderr.write(f"{PROG}: {run_dir} resumes with {ranks} local ranks: {shlex.join(argv)}\n")
        sys.stderr.flush()
        os.execv(sys.executable, argv)  # the launcher takes this process over: Ctrl-C reaches it as before
    from ddp_slurm.train import cli

    return cli.main(forwarded, stop=stop)


if __name__ == "__main__":
    sys.exit(main(stop=_early))
