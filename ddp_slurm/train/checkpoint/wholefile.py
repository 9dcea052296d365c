"""Atomic, verifiable checkpoints: ``<run_dir>/checkpoints/step-<N>.pt``.

Writing: rank 0 serialises to a temporary file in the same directory, flushes and fsyncs it,
``os.replace``s it into place and fsyncs the directory, so a reader (or a relaunch after SIGKILL)
sees either the previous set of checkpoints or the new one, never half a file. Only then are old
ones pruned to ``keep``.

Sealing (format 4, ``ckpt_seal``): a hash of every byte of the file (XXH3-128 of 16 MiB slices),
computed while the bytes are written and appended as a trailer. A zip container does not notice a
flipped bit inside tensor data (nor in the pickled step or epoch); the seal does. Format 3 sealed
with SHA-256 the same way; formats 1 and 2 kept a digest of the tensors and plain values inside the
pickle (``content_digest``), which had to be computed before the write began. All four load.

Reading: the seal first, then ``torch.load(weights_only=True)`` (a tampered file cannot run code) of the
same open file, then a structural check.
Which checkpoint a run resumes from, and whether it is this run's, is the gate's (``gate.py``), for
files and folders of shards alike. Pruning counts only files that load and hold the step their name
says (``listing.prune``); anything else in the folder is left alone.

torch's own CRC-32 of each zip record is switched off when saving: the seal already covers every byte
the CRC would, torch.load does not check it, and computing it cost a third of the save (0.2 s per
512 MiB, as much as the write itself).

What the seal does not do: it has no key, so anyone who can write the folder can write a file
that passes. Checkpoints written by other users are kept out by ownership and modes
(``safefs.check_trusted``, in the gate), not by the seal; a forged file can still not run code
(``weights_only``), and its values are checked before use (``schema.py``).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.serialization import config as torch_serialization

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import listing
from ddp_slurm.train.checkpoint import seal as ckpt_seal
from ddp_slurm.train.checkpoint.errors import CheckpointError
from ddp_slurm.train.checkpoint.listing import checkpoint_dir, list_checkpoints
from ddp_slurm.train.checkpoint.seal import Cancelled

log = logging.getLogger(__name__)

FORMAT = 4  # 4, 3: sealed (ckpt_seal: XXH3, SHA-256); 2: the digest inside the pickle; 1: also an older layout
READABLE_FORMATS = (1, 2, 3, 4)
SEALED_BY = {3: ckpt_seal.SHA256, 4: ckpt_seal.XXH3}  # the formats sealed by a trailer, and the seal each needs
REQUIRED = {
    "format": int,
    "model": dict,
    "step": int,
    "epoch": int,
    "finished": bool,
}


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
    """The digest formats 1 and 2 kept in ``state["content_sha256"]``: SHA-256 over the names, dtypes,
    shapes and bytes of every tensor outside that field, and over every plain value."""
    h = hashlib.sha256()
    body = {k: v for k, v in state.items() if k != "content_sha256"}
    for name, t in _tensors(body):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")  # no copy; hashlib drops the GIL
    h.update(repr(_skeleton(body)).encode())
    return h.hexdigest()


def file_name(step: int | str) -> str:
    """A checkpoint's file name: ``step-<N>.pt`` (``step`` may be a glob, ``"*"``)."""
    return RunPaths(".").checkpoint(step).name


def save(
    run_dir: Path,
    state: dict[str, Any],
    keep: int,
    shared: bool = False,
    *,
    cancel: threading.Event | None = None,
    seen: dict[Any, Any] | None = None,
    prune: Callable[[Path], None] | None = None,
    parents: bool = True,
) -> Path:
    """Write ``state`` as ``step-<state['step']>.pt`` atomically, then prune to the newest ``keep``.

    The temporary file is created exclusively under an unguessable name and never through a symlink
    (``safefs.write_atomic``); ``shared``: ``run.shared`` (file and directory modes).
    Raises CheckpointError (previous checkpoints untouched) when the directory cannot be written or
    the disk fills up; a half-written temporary file is removed. ``cancel`` (another thread sets it):
    the save stops before its next 16 MiB slice and raises Cancelled, leaving nothing behind.
    ``seen``: ``prune``'s memory of files already judged, kept by the caller across saves. ``prune(path)``:
    the caller's pruning instead (the checkpointer's, which judges by the run's live config); without it,
    files are judged against the config and model of the file just written. ``parents=False`` (the
    training run's writer): a run directory that is gone is not made again; the save fails with ``gone``.
    """
    folder = checkpoint_dir(run_dir)
    final = folder / file_name(state["step"])
    state = {k: v for k, v in state.items() if k != "content_sha256"} | {"format": FORMAT}
    sinks: list[ckpt_seal.Sink] = []

    def write(f: Any) -> None:
        sink = ckpt_seal.Sink(f, cancel)
        sinks.append(sink)
        with torch_serialization.patch({"save.compute_crc32": False}):
            torch.save(state, sink)
        if cancel is not None and cancel.is_set():  # before the fsync: the dirty pages go unwritten
            raise Cancelled
        sink.seal()

    try:
        safefs.make_dir(folder, shared, parents=parents)
        safefs.write_atomic(final, write, shared)
    except (OSError, RuntimeError, safefs.UnsafePath) as exc:  # torch.save reports a failed write as a RuntimeError
        if cancel is not None and cancel.is_set():
            raise Cancelled from None
        if not parents and not os.path.isdir(run_dir):
            raise gone(run_dir, final) from None
        exc = sinks[0].error if sinks and sinks[0].error is not None else exc
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise not_written(final, reason) from None
    if prune is not None:
        prune(final)
    else:
        listing.prune(
            list_checkpoints(run_dir),
            keep,
            final,
            summary_of=listing.summary,
            judge=listing.same_as(listing.identity(state)),
            remove=lambda p: p.unlink(missing_ok=True),
            seen=seen,
        )
    return final


def not_written(final: Path, reason: str) -> CheckpointError:
    """The one line for a checkpoint that could not be written (``reason``: the OS's, "No space left on device")."""
    return CheckpointError(
        f"cannot write checkpoint {final}: {reason}; previous checkpoints are intact, "
        "free space or fix permissions, then launch again to resume"
    )


def check_room(run_dir: Path, step: int, need: int) -> None:
    """CheckpointError (``not_written``, "No space left on device") when the file system of ``run_dir`` has
    less than ``need`` bytes free: a background write would fail there a few steps later, while training
    ran on; this way the run stops at the save itself. Where the file system does not say, nothing is
    checked (the write itself still fails cleanly)."""
    try:
        fs = os.statvfs(run_dir)
    except OSError:
        return
    free = (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) * fs.f_frsize  # root may use the reserve
    if free < need:
        raise not_written(checkpoint_dir(run_dir) / file_name(step), os.strerror(errno.ENOSPC))


def gone(run_dir: Path, what: Path) -> CheckpointError:
    """The one line for a run directory deleted or moved while the run trains: saving on would recreate it
    bare (no config, metrics or lock) and the run would end "finished" in a directory nobody looks at."""
    return CheckpointError(
        f"cannot write checkpoint {what}: the run directory {run_dir} is gone (deleted or moved while the run was "
        "training); stopping without recreating it: restore it or launch again to start over"
    )


def remove_stale_temporaries(run_dir: Path) -> None:
    """Temporary files left by a writer that was killed mid-save (never valid checkpoints)."""
    folder = checkpoint_dir(run_dir)
    if folder.is_dir():
        for p in folder.glob(safefs.temp_pattern(file_name("*"))):
            p.unlink(missing_ok=True)


def validate(state: Any, sealed: ckpt_seal.Scheme | None = None) -> None:
    """Raise ValueError if ``state`` is not a complete, untampered checkpoint. ``sealed``: the seal its
    file carries and passed (``ckpt_seal.check``); formats 3 and 4 need theirs (``SEALED_BY``), formats 1
    and 2 carry their own digest."""
    if not isinstance(state, dict):
        raise ValueError(f"not a checkpoint (a {type(state).__name__})")
    for key, tp in REQUIRED.items():
        if not isinstance(state.get(key), tp):
            raise ValueError(f"missing or wrong-typed {key!r}")
    if state["format"] not in READABLE_FORMATS:
        raise ValueError(f"format {state['format']} (this version reads formats {READABLE_FORMATS})")
    if state["format"] in SEALED_BY:
        if sealed is not SEALED_BY[state["format"]]:
            raise ValueError("no digest at the end of the file (cut short, or rewritten by another program)")
    elif not isinstance(state.get("content_sha256"), str) or content_digest(state) != state["content_sha256"]:
        raise ValueError("content digest mismatch (corrupted data)")
    for name, t in _tensors(state["model"]):
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"non-finite values in model tensor {name}")


def load(path: Path) -> dict[str, Any]:
    """Load and validate one checkpoint; ValueError with the reason when it is unusable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the launch
    except OSError as exc:
        raise ValueError(f"unreadable ({type(exc).__name__}: {exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("not a plain file")
    try:
        with os.fdopen(fd, "rb") as f:  # one open file for the seal and the load: never a seal of another file
            sealed = ckpt_seal.check(f)
            f.seek(0)
            state = torch.load(f, map_location="cpu", weights_only=True)
    except ckpt_seal.Mismatch:
        raise
    except Exception as exc:  # truncated zip, garbage, pickle with code in it, a read error, ...
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"unreadable ({type(exc).__name__}: {reason})") from None
    validate(state, sealed)
    return state
