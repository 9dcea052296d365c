"""Atomic, verifiable checkpoints: ``<run_dir>/checkpoints/step-<N>.pt``.

Writing: rank 0 serialises to a temporary file in the same directory, flushes and fsyncs it,
``os.replace``s it into place and fsyncs the directory, so a reader (or a relaunch after SIGKILL)
sees either the previous set of checkpoints or the new one, never half a file. Only then are old
ones pruned to ``keep``.

Reading: ``torch.load(weights_only=True)`` (a tampered file cannot run code), then a structural check
and a SHA-256 over every tensor's bytes and every plain value, recorded at save time. A zip container
does not notice a flipped bit inside tensor data (nor in the pickled step or epoch); the digest does. ``load_latest`` walks from the newest step down and
returns the first checkpoint that passes, warning about each one it skips.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^step-(\d+)\.pt$")
REQUIRED = {
    "format": int,
    "model": dict,
    "step": int,
    "epoch": int,
    "samples_in_epoch": int,
    "finished": bool,
    "content_sha256": str,
}


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be used, or one cannot be written. One line, names the files."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-N.pt``, newest first."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested state, with a stable path, in a stable order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{prefix}/{i}")


def _skeleton(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a marker: the plain values (step, epoch, config, ...)."""
    if isinstance(obj, torch.Tensor):
        return "<tensor>"
    if isinstance(obj, dict):
        return [(str(key), _skeleton(obj[key])) for key in sorted(obj, key=str)]
    if isinstance(obj, (list, tuple)):
        return [_skeleton(item) for item in obj]
    return obj


def content_digest(state: dict[str, Any]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of every tensor outside the digest field, and
    over every plain value: a flipped bit in the pickled step or epoch must not pass either."""
    h = hashlib.sha256()
    body = {k: v for k, v in state.items() if k != "content_sha256"}
    for name, t in _tensors(body):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")  # no copy; hashlib drops the GIL
    h.update(repr(_skeleton(body)).encode())
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(tmp: Path) -> None:
    """Remove a half-written temporary file; on a read-only file system even that fails (EROFS)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


class _Sink:
    """The file object torch.save writes to, keeping the first OSError: torch's zip writer turns a
    failed write (ENOSPC, EDQUOT, EIO) into "unexpected pos 326144 vs 326036" and loses the reason."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._f.flush()


def save(run_dir: Path, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` as ``step-<state['step']>.pt`` atomically, then prune to the newest ``keep``.

    Raises CheckpointError (previous checkpoints untouched) when the directory cannot be written or
    the disk fills up; a half-written temporary file is removed.
    """
    folder = checkpoint_dir(run_dir)
    final = folder / f"step-{state['step']}.pt"
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    state = dict(state, format=FORMAT)
    state["content_sha256"] = content_digest(state)
    sink: _Sink | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            sink = _Sink(f)
            torch.save(state, sink)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(folder)
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
        _discard(tmp)
        exc = sink.error if sink is not None and sink.error is not None else exc
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise CheckpointError(
            f"cannot write checkpoint {final}: {reason}; previous checkpoints are intact, "
            "free space or fix permissions, then launch again to resume"
        ) from None
    except BaseException:  # anything else (a state pickle cannot write, KeyboardInterrupt): no half file left
        _discard(tmp)
        raise
    for _, old in list_checkpoints(run_dir)[keep:]:
        old.unlink(missing_ok=True)
    return final


def remove_stale_temporaries(run_dir: Path) -> None:
    """Temporary files left by a writer that was killed mid-save (never valid checkpoints)."""
    folder = checkpoint_dir(run_dir)
    if folder.is_dir():
        for p in folder.glob(".step-*.pt.tmp-*"):
            p.unlink(missing_ok=True)


def validate(state: Any) -> None:
    """Raise ValueError if ``state`` is not a complete, untampered checkpoint."""
    if not isinstance(state, dict):
        raise ValueError(f"not a checkpoint (a {type(state).__name__})")
    for key, tp in REQUIRED.items():
        if not isinstance(state.get(key), tp):
            raise ValueError(f"missing or wrong-typed {key!r}")
    if state["format"] != FORMAT:
        raise ValueError(f"format {state['format']} (this version reads {FORMAT})")
    if content_digest(state) != state["content_sha256"]:
        raise ValueError("content digest mismatch (corrupted data)")
    for name, t in _tensors(state["model"]):
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"non-finite values in model tensor {name}")


def load(path: Path) -> dict[str, Any]:
    """Load and validate one checkpoint; ValueError with the reason when it is unusable."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, garbage, pickle with code in it, ...
        raise ValueError(f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    validate(state)
    return state


def latest(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """``(path, state)`` of the newest checkpoint that loads and validates; None when there is none.

    Raises CheckpointError when checkpoints exist but none is usable: starting over silently would
    throw away the run's finished work.
    """
    candidates = list_checkpoints(run_dir)
    for _, path in candidates:
        try:
            return path, load(path)
        except ValueError as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
    if candidates:
        names = ", ".join(p.name for _, p in candidates)
        raise CheckpointError(
            f"no usable checkpoint in {checkpoint_dir(run_dir)} ({names} all failed to load); "
            "refusing to start over: move them away or choose a new run.name"
        )
    return None


def load_latest(run_dir: str | Path) -> dict[str, Any] | None:
    """The newest valid checkpoint of ``run_dir`` (``model`` without DDP's ``module.`` prefix, ``step``,
    ``epoch``, ...), or None where there is none. See ``latest`` for the error case."""
    found = latest(Path(run_dir))
    return None if found is None else found[1]
