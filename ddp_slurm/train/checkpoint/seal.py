"""A checkpoint file's seal: a tree hash of every byte ``torch.save`` wrote, computed while the bytes are
written, appended after the zip archive as one fixed-length line.

The seal: the file's bytes before the trailer, cut into ``SLICE`` (16 MiB) slices from its start (the
last one shorter), each hashed; the seal is the hash of those digests, concatenated. The trailer's
magic names the hash. Format 4 writes XXH3-128 (the ``xxhash`` library): about 30 GiB/s on one core,
so one thread hashes each slice before writing it and the hash is not what a save waits for (0.02 s
for 512 MiB). Format 3 wrote SHA-256 (1.4 GiB/s: 0.36 s of a core per 512 MiB, which a background
save took from training) and still loads. The seal guards against torn, cut-off and corrupted files,
not against someone forging one: like a SHA-256 without a key, it can be recomputed by anyone who can
write the file (see ``safefs`` for what keeps co-tenants out).

Why a trailer and not a field inside the pickle (formats 1 and 2 did that): a field must be known before
the first byte is written, so the whole state was hashed first and written after. Here each slice is
hashed as it is written, and after each slice the kernel is told to start writing it out
(``safefs.drop_cache``), so copying into the page cache and the disk's own writing overlap, and the
final fsync finds little left to do.

Zip readers find an archive's directory from its end and skip bytes after it: a sealed file still loads
with a plain ``torch.load`` (tests/test_checkpoint_seal.py checks it). The seal covers every byte of the
archive (tensor data, the pickled values, the zip headers), so any flipped bit or cut-off tail fails
``check``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import xxhash

from ddp_slurm import safefs

SLICE = 16 << 20


@dataclass(frozen=True)
class Scheme:
    """One way of sealing: the trailer's magic names it (a new hash or slice size is a new magic)."""

    magic: bytes
    new: Callable[[], Any]  # a hash object: .update(bytes), .digest(), .hexdigest()

    @property
    def trailer_bytes(self) -> int:
        return len(self.magic) + 2 * self.new().digest_size + 1  # the magic, hex digits, a newline

    def seal_of(self, slice_digests: list[bytes]) -> str:
        h = self.new()
        h.update(b"".join(slice_digests))
        return h.hexdigest()

    def trailer(self, hexdigest: str) -> bytes:
        return self.magic + hexdigest.encode("ascii") + b"\n"


XXH3 = Scheme(b"\nddp_slurm-xxh3-128-16MiB-slices ", xxhash.xxh3_128)  # format 4: what save writes
SHA256 = Scheme(b"\nddp_slurm-sha256-16MiB-slices ", hashlib.sha256)  # format 3: read only
SCHEMES = (XXH3, SHA256)


class Cancelled(Exception):
    """The save was cancelled (``checkpoint.save(cancel=...)``): nothing was written, the temporary file is gone."""


class Mismatch(ValueError):
    """A sealed file whose bytes do not match its seal."""


def hash_threads() -> int:
    """Threads to check a file with (``check``): the cores this process may use (Slurm's cpuset), up to 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class Sink:
    """The file object ``torch.save`` writes to: writes each piece slice by slice (a 4 GiB embedding is not
    one uninterruptible write), hashes each slice as it goes (``XXH3``), starts the disk writing behind
    it, checks ``cancel`` before each slice, and keeps the first OSError (torch's zip writer turns a
    failed write, ENOSPC or EIO, into "unexpected pos 326144 vs 326036" and loses the reason).
    Hashing and writing both drop the interpreter lock. ``seal()`` appends the trailer."""

    def __init__(self, f: IO[bytes], cancel: threading.Event | None = None) -> None:
        self._f, self._cancel = f, cancel
        self._slices: list[Any] = []  # one hash object per slice begun
        self._written = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        whole = memoryview(data).cast("B")  # torch hands over a view of its own memory: used only until we return
        try:
            at = 0
            while at < whole.nbytes:
                if self._cancel is not None and self._cancel.is_set():
                    raise Cancelled
                chunk = whole[at : at + SLICE - self._written % SLICE]  # up to the end of the current slice
                if self._written % SLICE == 0:
                    self._slices.append(XXH3.new())
                self._slices[-1].update(chunk)
                self._write_all(chunk)
                at, self._written = at + chunk.nbytes, self._written + chunk.nbytes
                if self._written % SLICE == 0:  # a slice is complete: the disk may start on it
                    self._f.flush()
                    safefs.drop_cache(self._f.fileno(), self._written - SLICE, SLICE)
        except OSError as exc:
            self.error = self.error or exc
            raise
        return whole.nbytes

    def _write_all(self, chunk: memoryview) -> None:
        while chunk.nbytes:  # an unbuffered file may take part of it
            chunk = chunk[self._f.write(chunk) :]

    def flush(self) -> None:
        self._f.flush()

    def seal(self) -> None:
        """Append the trailer: the seal of everything written so far."""
        try:
            self._f.write(XXH3.trailer(XXH3.seal_of([h.digest() for h in self._slices])))
        except OSError as exc:
            self.error = self.error or exc
            raise


def check(f: IO[bytes]) -> Scheme | None:
    """The seal of the open file ``f`` once every byte before it matches: None when it has no trailer
    (formats 1 and 2, or a file some other program wrote); Mismatch when it has one and something does
    not match. Slices are read and hashed by ``hash_threads()``."""
    fd, size = f.fileno(), os.fstat(f.fileno()).st_size
    for scheme in SCHEMES:  # the one whose trailer ends the file
        body = size - scheme.trailer_bytes
        tail = os.pread(fd, scheme.trailer_bytes, body) if body >= 0 else b""
        if tail.startswith(scheme.magic):
            break
    else:
        return None

    def digest(start: int) -> bytes:
        data = os.pread(fd, min(SLICE, body - start), start)
        if len(data) != min(SLICE, body - start):  # the file shrank under us
            raise Mismatch("content digest mismatch (the file changed while read)")
        h = scheme.new()
        h.update(data)
        return h.digest()

    with ThreadPoolExecutor(hash_threads()) as pool:
        digests = list(pool.map(digest, range(0, body, SLICE)))
    if scheme.seal_of(digests) != tail[len(scheme.magic) : -1].decode("ascii", "replace"):
        raise Mismatch("content digest mismatch (corrupted data)")
    return scheme
