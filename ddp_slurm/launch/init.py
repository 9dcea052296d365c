"""``ddp-slurm init DIR``: copy the sbatch scripts and job configs into DIR, ready to edit and submit.

For users who installed the package (``pip install ddp_slurm``) rather than cloning the repository:
the files are the repository's ``sbatch/*.sh`` and ``jobs/*.yaml``, shipped inside the wheel under
``ddp_slurm/assets/`` (copied there at build time by ``setup.py``). In a checkout or an editable
install they are read from the top of the repository, so there is only ever one copy to edit.

``--task SPEC`` (``my_project.tasks:Digits``, ``path/file.py:Digits``) also writes ``DIR/jobs/<task>.yaml``:
that task's own sections and the runtime's, every key at its default under its explanation, headed by the
sbatch lines that submit it. It imports the task named (the user's own, as training would).

Exit status: 0 copied; 2 a file would be overwritten (without ``--force``), DIR is not a directory, or
the task cannot be used: nothing copied.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import ddp_slurm
from ddp_slurm import errors, safefs
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


def job_yaml(spec: str) -> tuple[str, str]:
    """``(file name, text)`` of the job config for task ``spec``; ConfigError (one line) for a task that
    cannot be used."""
    from ddp_slurm import config
    from ddp_slurm.config import doc

    cfg = config.load(overrides=[f"task={spec}"])
    name = f"{cfg.task.rpartition(':')[2].rpartition('.')[2].lower()}.yaml"
    head = (
        f"# Job config for task {cfg.task}, written by `ddp-slurm init --task`: every key at its default.\n"
        "# Edit it (slurm.partition, slurm.account, slurm.mem and the task's sections first), then submit it\n"
        "# from the directory holding jobs/ and sbatch/:\n"
        f"#   python -m ddp_slurm.submit --config jobs/{name} --dry-run   # what it asks Slurm for, and warnings\n"
        f"#   sbatch sbatch/mnist_4node.sh --config jobs/{name}           # one rank per GPU, started by srun\n"
        f"#   sbatch sbatch/mnist_torchrun.sh --config jobs/{name}        # one torchrun agent per node\n"
        "# (the scripts' #SBATCH lines ask for nodes and GPUs; `sbatch --nodes=2 ...` overrides them)\n"
    )
    return name, head + doc.render(cfg, explain=True)


def plan(dest: Path) -> list[tuple[Path, Path]]:
    """(source, destination) of every file to copy."""
    return [
        (src, dest / folder / src.name)
        for folder, pattern in SHIPPED.items()
        for src in sorted(asset_dir(folder).glob(pattern))
    ]


def init(dest: Path, force: bool = False, task: str | None = None) -> list[Path]:
    """Copy the files into ``dest`` (created if needed), and ``task``'s job config; checks everything (the
    task included) before writing anything."""
    if dest.exists() and not dest.is_dir():
        raise InitError(f"{dest} exists and is not a directory: choose a directory")
    copies = plan(dest)
    job = job_yaml(task) if task is not None else None
    targets = [to for _, to in copies] + ([dest / "jobs" / job[0]] if job else [])
    clash = [to for to in targets if os.path.lexists(to)]  # a dangling link is there too
    if clash and not force:
        raise InitError(
            f"{clash[0]} exists (and {len(clash) - 1} more): pass --force to overwrite, or choose another DIR"
        )
    # Nothing is written through a link planted in DIR: the folders must be real ones (safefs.make_dir), and
    # each file is written beside its name and renamed onto it, which replaces a link instead of following it.
    dest.mkdir(parents=True, exist_ok=True)
    for folder in sorted({to.parent for to in targets}):
        safefs.make_dir(folder, parents=False)
    for src, to in copies:
        _write(to, src.read_bytes(), (src.stat().st_mode & 0o777) | (0o111 if to.suffix == ".sh" else 0))
    if job is not None:
        _write(dest / "jobs" / job[0], job[1].encode(), 0o644)
    return targets


def _write(to: Path, data: bytes, mode: int) -> None:
    def fill(f) -> None:
        f.write(data)
        os.fchmod(f.fileno(), mode)  # the file just made, never a link's target

    safefs.write_atomic(to, fill)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddp-slurm init",
        description="Copy the sbatch scripts (sbatch/) and job configs (jobs/) into DIR, to edit and submit from there.",
    )
    parser.add_argument("dir", type=Path, metavar="DIR", nargs="?", default=Path("."), help="default: here")
    parser.add_argument("--force", action="store_true", help="overwrite files that exist")
    parser.add_argument(
        "--task",
        metavar="SPEC",
        help="also write jobs/<task>.yaml for this task (package.module:Name or path/file.py:Name): its sections, "
        "the runtime's, and the sbatch lines that submit it",
    )
    args = parser.parse_args(argv)
    try:
        written = init(args.dir, args.force, args.task)
    except (InitError, OSError, errors.UsageError) as exc:
        print(f"ddp-slurm init: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for path in written:
        print(f"wrote {path}")
    job = written[-1].name if args.task else "mnist.yaml"
    submit = f"sbatch sbatch/mnist_4node.sh --config jobs/{job}" if args.task else "sbatch sbatch/mnist_4node.sh"
    print(f"next: cd {args.dir} && {submit}   (edit the #SBATCH lines and jobs/{job} first)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
