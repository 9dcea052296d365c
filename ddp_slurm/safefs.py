"""Files a run writes and reads on a file system other users share (``/project/<group>/...``).

Writing: nothing the run writes follows a symlink or reuses a file somebody else put there first.
New files are created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``) under a temporary name, fsynced
and renamed into place (``write_atomic``); files that must be reopened across launches (the run
lock, ``metrics.jsonl``) are opened with ``O_NOFOLLOW`` and refused unless they are plain files owned
by this user (``open_owned``). A planted symlink, FIFO or foreign file is an ``UnsafePath`` error,
never a write into somebody else's file.

Modes: run directories are created ``0750`` and files ``0640`` (the group may read results, nobody
else may read, only the owner may write); ``run.shared=true`` (a team run several users resume)
makes them ``0770``/``0660``. The umask can only make a private run's modes stricter; a team run's are
set explicitly (``fchmod``), since the common login umask ``022`` would strip the group's write bit and
teammates could not resume.

Reading for resume: ``check_trusted`` refuses a run directory, config or checkpoint owned by another
user, or writable by others, or (unless ``run.shared``) writable by the group: whoever can write a
checkpoint decides what the next launch loads. The checkpoints' seal has no key and only
catches accidental corruption (a flipped bit, a truncated copy); against a writer with access, the
only defence is this ownership and mode check.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ddp_slurm import errors
from ddp_slurm.runpaths import RunPaths

DIR_MODE, FILE_MODE = 0o750, 0o640
SHARED_DIR_MODE, SHARED_FILE_MODE = 0o770, 0o660
# O_NONBLOCK: opening a planted FIFO must fail or return at once, not hang the launch.
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_REOPEN = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UnsafePath(errors.UsageError):
    """A path the run must not write or trust (symlink, not a plain file, foreign owner, loose mode): exit 2."""


def modes(shared: bool) -> tuple[int, int]:
    """(directory mode, file mode) for a private or a team (``run.shared``) run."""
    return (SHARED_DIR_MODE, SHARED_FILE_MODE) if shared else (DIR_MODE, FILE_MODE)


def make_dir(path: Path, shared: bool = False, parents: bool = True) -> None:
    """Create ``path`` (and, with ``parents``, missing parents) with the run's directory mode; an existing
    entry must be a real directory, not a symlink to one. ``parents=False``: FileNotFoundError when the
    parent is gone (a checkpoints folder never brings back a run directory deleted under the run)."""
    path = Path(path)
    dir_mode, _ = modes(shared)
    if parents and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)  # output_root: the umask's mode, like any mkdir -p
    try:
        os.mkdir(path, dir_mode)
        if shared:
            os.chmod(path, dir_mode)  # the umask took the group's write bit: a team run needs it
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is a {_kind(st.st_mode)}, not a directory: remove it or choose another run.name")


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISDIR(mode):
        return "directory"
    return "plain file" if stat.S_ISREG(mode) else "special file"


def tighten_umask(shared: bool = False) -> None:
    """For processes whose files a library creates (submitit's job folders and result pickles): never
    group-writable (unless ``shared``) and never readable by others, whatever the login umask."""
    old = os.umask(0o077)
    os.umask(old | (0o007 if shared else 0o027))


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(final: Path) -> Path:
    """A temporary name next to ``final``: unguessable, so nobody can plant it in advance."""
    return final.with_name(temp_pattern(final.name, os.getpid()).replace("*", secrets.token_hex(4)))


def temp_pattern(name: str, pid: int | None = None) -> str:
    """The glob matching what ``temp_name`` makes for file ``name`` (a glob too) in process ``pid``,
    or in any process (also the ``.tmp-<pid>`` names of earlier versions)."""
    return f".{name}.tmp-{pid}-*" if pid is not None else f".{name}.tmp-*"


def open_new(path: Path, shared: bool = False) -> int:
    """A new file at ``path``, created exclusively, never through a symlink: returns the fd."""
    fd = os.open(path, _NEW, modes(shared)[1])
    if shared:
        _team_mode(fd)
    return fd


def _team_mode(fd: int) -> None:
    """A team run's file mode whatever the umask, on a file of ours (a teammate's keeps its own)."""
    if os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, SHARED_FILE_MODE)


def write_atomic(
    final: Path, write: Callable[[IO[bytes]], None], shared: bool = False, scratch: Path | None = None
) -> None:
    """``write(f)`` into an exclusive temporary file, fsync, rename onto ``final``, fsync the directory:
    a reader sees the old file or the new one. ``final`` itself may exist (it is replaced, and a
    symlink there is replaced, not followed). The temporary file is removed on any failure.

    Once fsynced, the file's pages leave the page cache (``POSIX_FADV_DONTNEED``): nothing reads a
    checkpoint back soon, a cache full of them evicts what training does read, and the next large
    write then reuses those pages instead of taking memory never used before (5x slower on virtual
    machines whose host backs guest memory on first touch: 512 MiB in 2.2 s instead of 0.4 s).

    ``scratch``: where the temporary file lives instead (a folder on the same file system), for a folder
    whose readers take every name holding some prefix, subfolders included (a killed writer would leave its
    temporary there): there the temporary's name does not hold ``final``'s.
    """
    final = Path(final)
    tmp = temp_name(final)
    if scratch is not None:  # a folder of its own, and a name of its own: nothing half-written a reader takes
        tmp = temp_name(Path(scratch) / "write")
    try:
        with os.fdopen(open_new(tmp, shared), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            drop_cache(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # read-only file system: nothing was created either
            pass
        raise
    fsync_dir(final.parent)


def drop_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    """Tell the kernel that bytes ``offset .. offset+length`` of ``fd`` (0: to the end) will not be read soon
    (``POSIX_FADV_DONTNEED``). Clean pages leave the page cache at once; dirty ones are first queued for
    writing (Linux starts their writeback without waiting), so called as a file grows it also makes the
    disk write behind the writer. A no-op where the call does not exist (macOS)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def open_owned(path: Path, flags: int, shared: bool = False) -> int:
    """Open (creating if missing) a file that lives across launches, without following a symlink; it must
    be a plain file owned by this user. ``flags``: the access mode (``os.O_RDWR``, ``os.O_WRONLY |
    os.O_APPEND``)."""
    try:
        fd = os.open(path, flags | _REOPEN, modes(shared)[1])
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # ELOOP: a symlink there; ENXIO: a FIFO nobody reads
            kind = _kind(os.lstat(path).st_mode)
            raise UnsafePath(f"{path} is a {kind}, not a file this run wrote: remove it, then launch again") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(
                f"{path} is a {_kind(st.st_mode)}, not a file this run wrote: remove it, then launch again"
            )
        if st.st_uid != os.geteuid() and not shared:
            raise UnsafePath(
                f"{path} belongs to uid {st.st_uid}, not to you: remove it (or set run.shared=true for a team run)"
            )
        if shared:
            _team_mode(fd)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_owned(path: Path, text: str, shared: bool = False) -> None:
    """Append ``text`` to a file that lives across launches (a node list, a log of events): created if
    missing, never through a symlink, never into a FIFO, device or another user's file (``open_owned``:
    ``UnsafePath``). One ``write`` with ``O_APPEND``: lines from several processes land whole. A last line
    that a killed writer left without its newline is ended first, so the new one is never glued onto it."""
    fd = open_owned(Path(path), os.O_RDWR | os.O_APPEND, shared)
    try:
        data = text.encode()
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


def read_small(path: Path, limit: int = 1 << 20) -> str | None:
    """The text of a small file the run itself wrote (a node list, a manifest), or None when it does not
    exist. Never follows a symlink (``/dev/zero`` behind one would fill memory), never blocks on a FIFO,
    never reads more than ``limit`` bytes: ``UnsafePath`` names what is there instead of a plain file."""
    data = read_bytes(path, limit)
    return None if data is None else data.decode("utf-8", errors="replace")


def read_bytes(path: Path, limit: int) -> bytes | None:
    """``read_small``'s bytes, undecoded (a sealed index checks them before they are parsed)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise UnsafePath(
                f"{path} is a {_kind(os.lstat(path).st_mode)}, not a file this run wrote: remove it"
            ) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # before fdopen, which refuses a directory with a bare IsADirectoryError
        os.close(fd)
        raise UnsafePath(f"{path} is a {_kind(mode)}, not a file this run wrote: remove it")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafePath(f"{path} is larger than {limit} bytes: not a file this run wrote; remove it")
    return data


def check_trusted(path: Path, shared: bool = False, use: str = "resume from", published: bool = False) -> None:
    """Refuse to resume from ``path`` (a run directory, its config, a checkpoint or its folder) when
    someone else could have written it: a symlink, another owner, writable by others, or writable by
    the group (allowed with ``run.shared``, where the group is trusted and files may be a teammate's).
    ``use``: what was about to happen, for the message. ``published``: data another user may own and
    publish read-only (a shard index under a group's datasets); then only who can *write* it counts."""
    path = Path(path)
    st = os.lstat(path)
    fix = f"chmod go-w {path}"
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"refusing to {use} {path}: it is a symlink; replace it with the real directory or file")
    if st.st_mode & stat.S_IWOTH:
        raise UnsafePath(f"refusing to {use} {path}: it is writable by every user; {fix} if its content is yours")
    if published and st.st_uid != os.geteuid():
        if st.st_mode & stat.S_IWGRP and not shared:
            raise UnsafePath(f"refusing to {use} {path}: another user's, and writable by the group; {fix}")
        return
    if shared:
        if st.st_uid != os.geteuid() and st.st_gid not in _my_groups():
            raise UnsafePath(
                f"refusing to {use} {path}: owned by uid {st.st_uid}, group {st.st_gid}, neither "
                "yours nor one of your groups; choose another run.name"
            )
        return
    if st.st_uid != os.geteuid():
        raise UnsafePath(
            f"refusing to {use} {path}: owned by uid {st.st_uid}, not by you; copy the run to a "
            "directory of your own, or set run.shared=true for a team run"
        )
    if st.st_mode & stat.S_IWGRP:
        raise UnsafePath(
            f"refusing to {use} {path}: it is writable by the group; {fix}, or set run.shared=true for a team run"
        )


def _my_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def check_run_dir(run_dir: Path, shared: bool = False) -> None:
    """``check_trusted`` on an existing run directory and everything a resume reads from it (its config,
    the checkpoints folder and every ``step-*.pt`` in it), before the launch writes anything there."""
    paths = RunPaths(run_dir)
    run_dir, folder = paths.root, paths.checkpoints
    for path in (run_dir, paths.config, folder):
        if path == run_dir or os.path.lexists(path):
            check_trusted(path, shared)
    if folder.is_dir() and not folder.is_symlink():
        for path in sorted(folder.glob(paths.checkpoint("*").name)):
            check_trusted(path, shared)
