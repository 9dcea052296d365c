"""A checkpoint file's seal: the SHA-256 of every byte ``torch.save`` wrote, computed while the bytes are
written, appended after the zip archive as one fixed-length line (checkpoint format 3).

Why a trailer and not a field inside the pickle (formats 1 and 2 did that): a field must be known before
the first byte is written, so the whole state was hashed first and written after, and at disk speed the
hash takes as long as the write (512 MiB: 0.36 s of SHA-256, then 0.4 s of writing and fsync). Here each
piece torch.save hands over is hashed in a helper thread while the calling thread writes it (both drop
the interpreter lock), and every ``WRITE_BEHIND`` bytes the kernel is told to start writing the file out
(``safefs.drop_cache``), so hashing, copying into the page cache and the disk's own writing overlap, and
the final fsync finds little left to do.

Zip readers find an archive's directory from its end and skip bytes after it: a sealed file still loads
with a plain ``torch.load`` (tests/test_ckpt_seal.py checks it). The seal covers every byte of the
archive (tensor data, the pickled values, the zip headers), so any flipped bit or cut-off tail fails
``check``; like the digest before it, it has no key (see ``safefs`` for what keeps co-tenants out).
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import IO, Any

from ddp_slurm import safefs

MAGIC = b"\nddp_slurm-sha256 "
TRAILER_BYTES = len(MAGIC) + 64 + 1  # the magic, 64 hex digits, a newline
OVERLAP_MIN = 1 << 20  # pieces this big are hashed in the helper thread while written; smaller ones inline
WRITE_BEHIND = 16 << 20  # start the disk writing after every this many bytes (see the module docstring)
_READ = 8 << 20


class Cancelled(Exception):
    """The save was cancelled (``checkpoint.save(cancel=...)``): nothing was written, the temporary file is gone."""


class Mismatch(ValueError):
    """A sealed file whose bytes do not match its seal."""


def trailer(hexdigest: str) -> bytes:
    return MAGIC + hexdigest.encode("ascii") + b"\n"


class Sink:
    """The file object ``torch.save`` writes to: writes each piece and hashes it at the same time, starts the
    disk writing behind it, checks ``cancel`` before each piece, and keeps the first OSError (torch's zip
    writer turns a failed write, ENOSPC or EIO, into "unexpected pos 326144 vs 326036" and loses the
    reason). A context manager: it owns the helper thread. ``seal()`` appends the trailer."""

    def __init__(self, f: IO[bytes], cancel: threading.Event | None = None) -> None:
        self._f, self._cancel = f, cancel
        self._sha = hashlib.sha256()
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
        self._written = self._behind = 0
        self.error: OSError | None = None

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._helper.shutdown()

    def write(self, data: Any) -> int:
        if self._cancel is not None and self._cancel.is_set():
            raise Cancelled
        piece = memoryview(data)  # torch hands over a view of its own memory: used only until we return
        try:
            if piece.nbytes >= OVERLAP_MIN:
                hashed = self._helper.submit(self._sha.update, piece)
                try:
                    n = self._f.write(piece)
                finally:
                    hashed.result()  # the view must not outlive this call, nor the hashes run out of order
            else:
                self._sha.update(piece)
                n = self._f.write(piece)
            self._written += n
            if self._written - self._behind >= WRITE_BEHIND:
                self._f.flush()
                safefs.drop_cache(self._f.fileno(), self._behind, self._written - self._behind)
                self._behind = self._written
        except OSError as exc:
            self.error = self.error or exc
            raise
        return n

    def flush(self) -> None:
        self._f.flush()

    def seal(self) -> None:
        """Append the trailer: the SHA-256 of everything written so far."""
        try:
            self._f.write(trailer(self._sha.hexdigest()))
        except OSError as exc:
            self.error = self.error or exc
            raise


def check(f: IO[bytes]) -> bool:
    """Whether the open file ``f`` is sealed: False when it has no trailer (formats 1 and 2, or a file
    some other program wrote); True when it has one and every byte before it matches; Mismatch
    when it has one and something does not match."""
    size = os.fstat(f.fileno()).st_size
    if size < TRAILER_BYTES:
        return False
    f.seek(size - TRAILER_BYTES)
    tail = f.read(TRAILER_BYTES)
    if not tail.startswith(MAGIC):
        return False
    recorded = tail[len(MAGIC) : -1].decode("ascii", "replace")
    h, left = hashlib.sha256(), size - TRAILER_BYTES
    f.seek(0)
    buf = bytearray(min(_READ, max(left, 1)))
    view = memoryview(buf)
    while left > 0:
        n = f.readinto(view[: min(left, len(buf))])
        if not n:
            break
        h.update(view[:n])
        left -= n
    if left or h.hexdigest() != recorded:
        raise Mismatch("content digest mismatch (corrupted data)")
    return True
