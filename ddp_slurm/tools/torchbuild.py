"""``python -m ddp_slurm.tools.torchbuild [cpu]``: which torch build an install got, said at its end.

``make`` runs it after every install (``TORCH=cpu`` or not). Why: pip falls back silently. Where
download.pytorch.org is unreachable, ``--extra-index-url .../whl/cpu`` retries for minutes and then takes
PyPI's torch, which is the CUDA build (gigabytes of ``nvidia-*`` wheels), without a word; and a ``.venv``
made earlier keeps whatever build it has. One line says the build and version; a ``WARNING`` line when it
is not the build that was asked for, with what to do. The exit status stays 0: the install did work.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("ddp_slurm.torchbuild")

CPU = "cpu"
"""The ``TORCH=`` value that asks for torch's CPU-only build."""


def describe(version: str, cuda: str | None) -> tuple[str, bool]:
    """``("torch 2.5.1+cpu: the CPU-only build", True)`` from torch's version and ``torch.version.cuda``;
    the bool says whether it is the CPU-only build."""
    if cuda:
        return f"torch {version}: the CUDA {cuda} build", False
    return f"torch {version}: the CPU-only build", True


def verdict(asked: str, version: str, cuda: str | None) -> tuple[str, str | None]:
    """The line to say, and a warning when the build is not the one ``asked`` (``"cpu"`` or ``""``)."""
    what, is_cpu = describe(version, cuda)
    line = f"installed {what}"
    if asked == CPU and not is_cpu:
        return line, (
            f"TORCH=cpu asked for the CPU-only build but .venv has {what} (download.pytorch.org unreachable, "
            "so pip took PyPI's?); check the network, then `rm -rf .venv && make run TORCH=cpu` (runs/ is kept)"
        )
    if asked != CPU and is_cpu:
        return line, (
            f".venv has {what}, which runs no GPU; for the CUDA build: `rm -rf .venv && make run` (runs/ is kept)"
        )
    return line, None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] not in ("", CPU)):
        sys.stderr.write(f"usage: python -m ddp_slurm.tools.torchbuild [{CPU}] (got {' '.join(args)!r})\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    import torch

    line, warning = verdict(args[0] if args else "", torch.__version__, torch.version.cuda)
    log.info("%s", line)
    if warning is not None:
        log.warning("%s", warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
