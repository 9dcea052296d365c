"""``ddp-slurm <command> ...`` (and ``python -m ddp_slurm``): every entry point as one console command.

Each command is the module's own ``main``, imported only once the command is known, so ``--help``
and ``--version`` never wait for torch.

One spelling in the docs. Every command answers to three: ``python -m ddp_slurm.<command>`` (a
module at the package's top), ``ddp-slurm <command>`` (this console command) and the module that
implements it (``python -m ddp_slurm.launch.submit``, ``ddp_slurm.tools.report``, ...). The docs,
the sbatch scripts and the contract show the first, because it is the one that works everywhere a
command runs: it names the interpreter (the job uses the Python the user chose, not whatever
``ddp-slurm`` comes first on a compute node's PATH), torchrun and ``srun torchrun`` can only start
a module (``-m ddp_slurm.train``), and a source checkout on ``PYTHONPATH`` needs no install. The
console command is the same thing, shorter on a login node; it is shown first only for ``init``,
which exists for an installed wheel, where there is no checkout and the console command is what
``pip`` installed. The implementing modules keep working (a layout change must not break a job
script) but are never shown: they are where the code lives, not what users type.
"""

from __future__ import annotations

import importlib
import sys

from ddp_slurm import __version__
from ddp_slurm.exitcodes import EXIT_OK, EXIT_USAGE

# command -> (module whose main() runs it, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("ddp_slurm.train.cli", "train (one rank of a run, or a 1-rank run): python -m ddp_slurm.train"),
    "resume": ("ddp_slurm.resume", "continue a run with its own config: ddp-slurm resume RUN_DIR [KEY=VALUE ...]"),
    "submit": ("ddp_slurm.launch.submit", "submit the training job through submitit (Slurm or this machine)"),
    "doctor": ("ddp_slurm.tools.doctor", "preflight of an allocation: rank map, addresses, one timed all-reduce"),
    "report": ("ddp_slurm.tools.report", "plots and summary of one or more run directories (or a sweep)"),
    "export": (
        "ddp_slurm.tools.export",
        "a run's model weights for inference: ddp-slurm export RUN_DIR [--best|--step N] OUT",
    ),
    "bench": ("ddp_slurm.bench.__main__", "throughput and overhead benchmarks"),
    "data": ("ddp_slurm.data", "fetch full MNIST on a machine with internet"),
    "init": ("ddp_slurm.launch.init", "copy the sbatch scripts and job configs into a directory"),
    "launch": ("ddp_slurm.launch.torchrun", "torchrun that survives Slurm's stop signal (srun ... ddp-slurm launch)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
    return (
        "usage: ddp-slurm [--version] <command> [arguments]\n\n"
        "PyTorch DistributedDataParallel on Slurm that survives preemption and resumes exactly.\n\n"
        f"commands:\n{rows}\n\n"
        "`ddp-slurm <command> --help` describes a command; `python -m ddp_slurm` is the same as `ddp-slurm`.\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return EXIT_OK if args else EXIT_USAGE
    if args[0] in ("-V", "--version"):
        print(f"ddp_slurm {__version__}")
        return EXIT_OK
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"ddp-slurm: error: unknown command {name!r}: choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return EXIT_USAGE
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv[0] = f"ddp-slurm {name}"  # what a command's own messages call it
    return module.main(rest)


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
