"""``python -m ddp_slurm.tools.torchbuild [cpu]``: which torch build an install got, said at its end;
``--reach URL``: whether torch's CPU wheel index answers, before ``TORCH=cpu``'s install asks it.

``make`` runs it after every install (``TORCH=cpu`` or not). Why: pip falls back silently, and a ``.venv``
made earlier keeps whatever build it has. One line says the build and version; a ``WARNING`` line when it
is not the build that was asked for, with what to do. The exit status stays 0: the install did work.
Where download.pytorch.org is blocked (login nodes often are), an install that names it retries it for
minutes; ``--reach`` says so at once instead (exit 1), and the install asks that index for torch and
torchvision alone, never for every package. Runs from the repository before the package is installed:
nothing here imports more than the standard library at module level.
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


REACH_TIMEOUT_S = 10.0


def reach(url: str, timeout: float = REACH_TIMEOUT_S) -> str | None:
    """None when ``url`` answers within ``timeout``; else why not, in a few words. Before ``TORCH=cpu``'s
    install: where the index is blocked (common on login nodes) pip would retry it for minutes."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:
        return None if exc.code < 500 else f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", None) or exc)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--reach":  # `make ... TORCH=cpu`, before the install: fail fast
        why = reach(args[1])
        if why is not None:
            sys.stderr.write(
                f"ERROR TORCH=cpu: {args[1]} cannot be reached ({why}), so torch's CPU-only build cannot be "
                "installed from it; use `make run` for PyPI's build (the CUDA one, 5.8 GB), or a proxy "
                "(HTTPS_PROXY) that reaches it\n"
            )
            return 1
        return 0
    if len(args) > 1 or (args and args[0] not in ("", CPU)):
        sys.stderr.write(
            f"usage: python -m ddp_slurm.tools.torchbuild [{CPU} | --reach URL] (got {' '.join(args)!r})\n"
        )
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
