"""A checkpoint file's seal: a SHA-256 tree hash of every byte ``torch.save`` wrote, computed while the bytes
are written, appended after the zip archive as one fixed-length line (checkpoint format 3).

The seal: the file's bytes before the trailer, cut into ``SLICE`` (16 MiB) slices from its start (the
last one shorter), each hashed with SHA-256; the seal is the SHA-256 of those digests, concatenated.
Slices hash independently, so as many cores as the save can have hash at once (a single SHA-256 stream
runs at about 1.4 GiB/s on one core: slower than the disks of the clusters this runs on).

Why a trailer and not a field inside the pickle (formats 1 and 2 did that): a field must be known before
the first byte is written, so the whole state was hashed first and written after, and at disk speed the
hash takes as long as the write (512 MiB: 0.36 s of SHA-256, then 0.4 s of writing and fsync). Here the
slices of each piece torch.save hands over are hashed in helper threads while the calling thread writes
the piece (both drop the interpreter lock), and after each slice the kernel is told to start writing it
out (``safefs.drop_cache``), so hashing, copying into the page cache and the disk's own writing overlap,
and the final fsync finds little left to do.

Zip readers find an archive's directory from its end and skip bytes after it: a sealed file still loads
with a plain ``torch.load`` (tests/test_ckpt_seal.py checks it). The seal covers every byte of the
archive (tensor data, the pickled values, the zip headers), so any flipped bit or cut-off tail fails
``check``; like the digest before it, it has no key (see ``safefs`` for what keeps co-tenants out).
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import IO, Any

from ddp_slurm import safefs

MAGIC = b"\nddp_slurm-sha256-16MiB-slices "  # the scheme: a new slice size would be a new magic
TRAILER_BYTES = len(MAGIC) + 64 + 1  # the magic, 64 hex digits, a newline
SLICE = 16 << 20
OVERLAP_MIN = 1 << 20  # chunks this big go to the helper threads (when there are any); smaller ones inline


class Cancelled(Exception):
    """The save was cancelled (``checkpoint.save(cancel=...)``): nothing was written, the temporary file is gone."""


class Mismatch(ValueError):
    """A sealed file whose bytes do not match its seal."""


def hash_threads() -> int:
    """Threads to hash with when the caller waits: the cores this process may use (Slurm's cpuset), up to 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def seal_of(slice_digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(slice_digests)).hexdigest()


def trailer(hexdigest: str) -> bytes:
    return MAGIC + hexdigest.encode("ascii") + b"\n"


class Sink:
    """The file object ``torch.save`` writes to: writes each piece slice by slice (a 4 GiB embedding is not
    one uninterruptible write), hashes each slice, starts the disk writing behind it, checks ``cancel``
    before each slice, and keeps the first OSError (torch's zip writer turns a failed write, ENOSPC or
    EIO, into "unexpected pos 326144 vs 326036" and loses the reason).

    ``threads``: helper threads that hash while the calling thread writes (``hash_threads()`` for a save
    the caller waits for); 0: one thread hashes and writes in turn (a background save, which should take
    as little CPU from training at a time as it can). A context manager: it owns the helper threads.
    ``seal()`` appends the trailer."""

    def __init__(self, f: IO[bytes], cancel: threading.Event | None = None, threads: int = 0) -> None:
        self._f, self._cancel = f, cancel
        self._slices: list[Any] = []  # one hashlib object per slice begun
        self._helpers = ThreadPoolExecutor(threads, thread_name_prefix="ckpt-hash") if threads else None
        self._written = 0
        self.error: OSError | None = None

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._helpers is not None:
            self._helpers.shutdown()

    def write(self, data: Any) -> int:
        whole = memoryview(data).cast("B")  # torch hands over a view of its own memory: used only until we return
        pending: list[Future[None]] = []
        try:
            at = 0
            while at < whole.nbytes:
                if self._cancel is not None and self._cancel.is_set():
                    raise Cancelled
                chunk = whole[at : at + SLICE - self._written % SLICE]  # up to the end of the current slice
                if self._written % SLICE == 0:
                    self._slices.append(hashlib.sha256())
                if self._helpers is not None and chunk.nbytes >= OVERLAP_MIN:  # each slice once per call: no race
                    pending.append(self._helpers.submit(self._slices[-1].update, chunk))
                else:
                    self._slices[-1].update(chunk)
                self._write_all(chunk)
                at, self._written = at + chunk.nbytes, self._written + chunk.nbytes
                if self._written % SLICE == 0:  # a slice is complete: the disk may start on it
                    self._f.flush()
                    safefs.drop_cache(self._f.fileno(), self._written - SLICE, SLICE)
        except OSError as exc:
            self.error = self.error or exc
            raise
        finally:
            for job in pending:  # the views must not outlive the call
                job.result()
        return whole.nbytes

    def _write_all(self, chunk: memoryview) -> None:
        while chunk.nbytes:  # an unbuffered file may take part of it
            chunk = chunk[self._f.write(chunk) :]

    def flush(self) -> None:
        self._f.flush()

    def seal(self) -> None:
        """Append the trailer: the seal of everything written so far."""
        try:
            self._f.write(trailer(seal_of([h.digest() for h in self._slices])))
        except OSError as exc:
            self.error = self.error or exc
            raise


def check(f: IO[bytes]) -> bool:
    """Whether the open file ``f`` is sealed: False when it has no trailer (formats 1 and 2, or a file
    some other program wrote); True when it has one and every byte before it matches; Mismatch
    when it has one and something does not match. Slices are read and hashed by ``hash_threads()``."""
    fd, size = f.fileno(), os.fstat(f.fileno()).st_size
    body = size - TRAILER_BYTES
    if body < 0:
        return False
    tail = os.pread(fd, TRAILER_BYTES, body)
    if not tail.startswith(MAGIC):
        return False

    def digest(start: int) -> bytes:
        data = os.pread(fd, min(SLICE, body - start), start)
        if len(data) != min(SLICE, body - start):  # the file shrank under us
            raise Mismatch("content digest mismatch (the file changed while read)")
        return hashlib.sha256(data).digest()

    with ThreadPoolExecutor(hash_threads()) as pool:
        digests = list(pool.map(digest, range(0, body, SLICE)))
    if seal_of(digests) != tail[len(MAGIC) : -1].decode("ascii", "replace"):
        raise Mismatch("content digest mismatch (corrupted data)")
    return True
