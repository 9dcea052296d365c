"""The rendezvous store of one job, closed to everyone outside it.

torch's ``tcp://`` rendezvous runs a TCPStore on rank 0 that listens on every interface at a port
anyone can compute from the job id, and the store has no authentication: another user on a login or
compute node can connect, read the ranks' keys and plant new ones (a fake heartbeat or verdict for
the watchdog). Two defences, both here:

* The store listens on the rendezvous address only (the address ``MASTER_ADDR`` resolves to), not on
  every interface. Where that address is a loopback one but the job spans several nodes (a host name
  mapped to 127.0.1.1), it has to listen on every interface, and only the second defence holds.
* Every key the job uses lives under a per-job secret prefix (``PrefixStore``). A TCPStore cannot
  list its keys, so without the secret an outsider can neither read the ranks' keys nor write any the
  job will ever look at; a process that connects without it waits on keys that never come and times
  out, while the job's own ranks meet under the prefix.

The secret: ``DDP_SLURM_SECRET`` from the environment if set (every rank of a job inherits it; other
users cannot read a process's environment), otherwise an HMAC of the job's identity (job id,
rendezvous address and port) under a per-user key, ``~/.config/ddp_slurm/rendezvous.key`` (0600,
made on first use; ``DDP_SLURM_KEY_FILE`` moves it). Home directories are shared by the nodes of
every cluster this targets, so all ranks of a job derive the same secret, and no other user can.
Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``) the agent owns the store and its
socket; the ranks still keep their keys under the secret prefix.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import socket
import stat
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddp_slurm.distributed import meet
from ddp_slurm.distributed.env import BootstrapError, DistEnv

SECRET_ENV = "DDP_SLURM_SECRET"
KEY_FILE_ENV = "DDP_SLURM_KEY_FILE"


def key_file(environ: Mapping[str, str]) -> Path:
    if environ.get(KEY_FILE_ENV):
        return Path(environ[KEY_FILE_ENV])
    base = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".config")
    return Path(base) / "ddp_slurm" / "rendezvous.key"


def _user_key(path: Path) -> bytes:
    """The per-user key, made on first use (concurrent ranks: the first link wins, all read it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not path.exists():
            tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_hex(32).encode())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic and exclusive: never replaces a key other ranks already read
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise BootstrapError(
                    f"rendezvous key {path} is not private (owner uid {st.st_uid}, mode "
                    f"{stat.S_IMODE(st.st_mode):o}): run `chmod 600 {path}` or remove it, or set {SECRET_ENV}"
                )
            key = f.read().strip()
    except OSError as exc:
        raise BootstrapError(
            f"cannot read or make the rendezvous key {path} ({exc.strerror or exc}): set {SECRET_ENV} "
            f"to the same random string for every rank, or {KEY_FILE_ENV} to a writable private file"
        ) from None
    if len(key) < 32:
        raise BootstrapError(f"rendezvous key {path} is too short: remove it (it is remade) or set {SECRET_ENV}")
    return key


def job_secret(env: DistEnv, environ: Mapping[str, str]) -> str:
    """The job's secret key prefix (hex, 128 bits), the same on every rank of the job."""
    given = environ.get(SECRET_ENV)
    key = given.encode() if given else _user_key(key_file(environ))
    identity = f"{env.job_id or '-'}|{env.master_addr}|{env.master_port}".encode()
    return hmac.new(key, identity, hashlib.sha256).hexdigest()[:32]


def bind_address(env: DistEnv) -> str:
    """Where rank 0's store listens: the rendezvous address, or every interface ("") where that is a
    loopback address but other nodes must reach it."""
    try:
        addr = socket.getaddrinfo(env.master_addr, env.master_port, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return ""
    loopback = addr.startswith("127.") or addr == "::1"
    return "" if loopback and env.num_nodes > 1 else addr


def _listen(addr: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(4096)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:  # the words torch uses too: the caller turns them into one line
            raise RuntimeError(f"EADDRINUSE: address already in use ({addr or '*'}:{port})") from None
        raise RuntimeError(f"cannot listen on {addr or '*'}:{port}: {exc.strerror}") from None
    return sock


def uses_agent_store(environ: Mapping[str, str]) -> bool:
    return environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def job_store(
    env: DistEnv, timeout: timedelta, environ: Mapping[str, str], stopped: Callable[[], bool] | None = None
) -> Any:
    """The job's store, as ``init_process_group(store=...)`` takes it, once every rank has met on it
    (``meet``: bounded by the timeout, interrupted by ``stopped()``): rank 0 hosts it (unless torchrun's
    agent does), bound to the rendezvous address; every rank sees it through the secret prefix. Raises
    RuntimeError as torch's rendezvous would (port in use, timeout with "x/y clients joined"), so that the
    caller's messages stay the same; RendezvousError (one line) when the wait ends without torch's."""
    import torch.distributed as dist

    secret = job_secret(env, environ)
    host = env.master_addr
    hosting = env.rank == 0 and not uses_agent_store(environ)

    def connect() -> Any:
        if hosting:
            sock = _listen(bind_address(env), env.master_port)
            try:
                return dist.TCPStore(
                    host, env.master_port, env.world_size, True, timeout, master_listen_fd=sock.fileno()
                )
            finally:
                sock.detach()  # the store owns the listening socket now, and closes it even when it fails
        return dist.TCPStore(host, env.master_port, env.world_size, False, timeout)

    return meet.meet(
        env,
        timeout.total_seconds(),
        environ,
        connect,
        lambda store: dist.PrefixStore(f"{secret}/", store),
        hosting,
        stopped,
    )
