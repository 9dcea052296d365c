"""``ddp-slurm init DIR``: copy the sbatch scripts and job configs into DIR, ready to edit and submit.

For users who installed the package (``pip install ddp_slurm``) rather than cloning the repository:
the files are the repository's ``sbatch/*.sh`` and ``jobs/*.yaml``, shipped inside the wheel under
``ddp_slurm/assets/`` (copied there at build time by ``setup.py``). In a checkout or an editable
install they are read from the top of the repository, so there is only ever one copy to edit.

Exit status: 0 copied; 2 a file would be overwritten (without ``--force``) or DIR is not a
directory: nothing copied.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import ddp_slurm
from ddp_slurm import errors
from ddp_slurm.exitcodes import EXIT_OK, EXIT_USAGE

SHIPPED = {"jobs": "*.yaml", "sbatch": "*.sh"}


class InitError(errors.UsageError):
    """The files cannot be found or copied; the message is one line (exit 2)."""


def asset_dir(folder: str) -> Path:
    """Where ``folder`` (``jobs`` or ``sbatch``) of this installation is: inside the package (wheel),
    or at the top of the source tree (checkout, editable install)."""
    package = Path(ddp_slurm.__file__).resolve().parent
    for candidate in (package / "assets" / folder, package.parent / folder):
        if candidate.is_dir() and any(candidate.glob(SHIPPED[folder])):
            return candidate
    raise InitError(f"this installation of ddp_slurm has no {folder}/ files (looked in {package}/assets): reinstall it")


def asset(relative: str) -> Path:
    """``asset("jobs/mnist.yaml")``: the path of one shipped file."""
    folder, _, name = relative.partition("/")
    path = asset_dir(folder) / name
    if not path.is_file():
        raise InitError(f"no {relative} in this installation of ddp_slurm")
    return path


def plan(dest: Path) -> list[tuple[Path, Path]]:
    """(source, destination) of every file to copy."""
    return [
        (src, dest / folder / src.name)
        for folder, pattern in SHIPPED.items()
        for src in sorted(asset_dir(folder).glob(pattern))
    ]


def init(dest: Path, force: bool = False) -> list[Path]:
    """Copy the files into ``dest`` (created if needed); checks everything before writing anything."""
    if dest.exists() and not dest.is_dir():
        raise InitError(f"{dest} exists and is not a directory: choose a directory")
    copies = plan(dest)
    clash = [to for _, to in copies if to.exists()]
    if clash and not force:
        raise InitError(
            f"{clash[0]} exists (and {len(clash) - 1} more): pass --force to overwrite, or choose another DIR"
        )
    for src, to in copies:
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, to)
        if to.suffix == ".sh":
            to.chmod(to.stat().st_mode | 0o111)
    return [to for _, to in copies]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddp-slurm init",
        description="Copy the sbatch scripts (sbatch/) and job configs (jobs/) into DIR, to edit and submit from there.",
    )
    parser.add_argument("dir", type=Path, metavar="DIR", nargs="?", default=Path("."), help="default: here")
    parser.add_argument("--force", action="store_true", help="overwrite files that exist")
    args = parser.parse_args(argv)
    try:
        written = init(args.dir, args.force)
    except (InitError, OSError) as exc:
        print(f"ddp-slurm init: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for path in written:
        print(f"wrote {path}")
    print(f"next: cd {args.dir} && sbatch sbatch/mnist_4node.sh   (edit the #SBATCH lines and jobs/mnist.yaml first)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
