"""Join and leave the process group: threads, device and backend, the gloo interface, rendezvous errors.

``torch`` is imported inside the functions only, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddp_slurm import hostmem
from ddp_slurm.distributed import groups, rdzv
from ddp_slurm.distributed.env import BootstrapError, DistEnv, RendezvousError, _int

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def configure_threads(env: DistEnv, environ: Mapping[str, str]) -> int:
    """Set ``torch.set_num_threads`` to this rank's share of the CPUs and return it.

    In an srun step that is ``SLURM_CPUS_PER_TASK``; otherwise ``OMP_NUM_THREADS`` when set;
    otherwise the CPUs this process may run on divided among the ranks on the node, so ranks
    sharing a machine never oversubscribe it.
    """
    import torch

    omp = _int(environ, "OMP_NUM_THREADS", minimum=1)
    on_node = _int(environ, "SLURM_CPUS_ON_NODE", minimum=1)
    if env.launcher == "slurm" and env.cpus_per_task:
        threads = env.cpus_per_task
    elif omp is not None:
        threads = omp[1]
    else:
        try:
            cpus = len(os.sched_getaffinity(0))  # respects cgroups/cpusets, unlike cpu_count
        except AttributeError:  # not available on macOS
            cpus = os.cpu_count() or 1
        threads = cpus // env.local_world_size
        if env.launcher == "slurm" and on_node is not None:
            # srun may already have bound each task to its own CPUs: then the affinity mask
            # is this task's share, and dividing it again would leave cores idle.
            threads = min(cpus, on_node[1] // env.local_world_size)
        threads = max(1, threads)
    torch.set_num_threads(threads)
    return threads


def pick_device_and_backend(
    requested: str, local_rank: int, local_world_size: int = 1, gpus_per_task: int | None = None
) -> tuple[torch.device, str]:
    """Choose the backend (``auto``, ``nccl`` or ``gloo``) and this rank's device.

    The GPU is ``local_rank % device_count``: CUDA_VISIBLE_DEVICES is never rewritten, so
    with ``srun --gpus-per-task=1`` every task sees one device and uses index 0. Where a task sees
    several GPUs but the node has more ranks than that, two ranks would share a GPU: NCCL then
    fails with "invalid usage" (or two ranks crowd one device), so that is refused here, on every
    rank of the node alike, before any rank joins the group. ``gpus_per_task``: ``bound_gpus_per_task``.
    """
    import torch

    if requested not in ("auto", "nccl", "gloo"):
        raise BootstrapError(f"backend {requested!r} is not one of 'auto', 'nccl', 'gloo'")
    has_cuda = torch.cuda.is_available()
    if requested == "nccl" and not has_cuda:
        raise BootstrapError("backend 'nccl' needs a CUDA GPU but torch sees none: use 'gloo' or 'auto'")
    backend = ("nccl" if has_cuda else "gloo") if requested == "auto" else requested
    if not has_cuda:
        return torch.device("cpu"), backend
    count = torch.cuda.device_count()
    check_gpu_sharing(count, local_rank, local_world_size, gpus_per_task)
    device = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(device)
    return device, backend


def bound_gpus_per_task(launcher: str, environ: Mapping[str, str]) -> int | None:
    """The GPUs Slurm bound to this rank's own task (``--gpus-per-task=N``, which implies
    ``--gpu-bind=per_task:N``), where each rank is a task of its own (``launcher == "slurm"``, srun);
    None otherwise (torchrun's ranks share their task's GPUs; no such request; a value not understood).
    ``SLURM_GPUS_PER_TASK`` is ``[type:]N``."""
    value = environ.get("SLURM_GPUS_PER_TASK", "").rsplit(":", 1)[-1]
    return int(value) if launcher == "slurm" and value.isdigit() and int(value) > 0 else None


def check_gpu_sharing(count: int, local_rank: int, local_world_size: int, gpus_per_task: int | None = None) -> None:
    """Refuse a node whose ranks would share GPUs: one line that names the pair and the fix.

    One visible GPU per task is fine whatever the number of ranks: that is Slurm's per-task
    binding (``--gpus-per-task=1``), where every task's "GPU 0" is another device. So are N visible
    GPUs where Slurm bound N to each task (``gpus_per_task == count``, ``--gpus-per-task=N`` under
    srun): every GPU a rank sees is its task's own; the rank uses one of them (``local_rank % count``)
    and the others idle. Two ranks that still land on one device are caught by NCCL ("Duplicate GPU
    detected"), whose line ``_rendezvous_error`` keeps.
    """
    ranks = max(local_world_size, local_rank + 1)
    if count <= 1 or ranks <= count or gpus_per_task == count:
        return
    first = count if local_rank < count else local_rank  # the first rank past the GPUs, or this one
    raise BootstrapError(
        f"{ranks} ranks on this node but each sees only {count} GPUs: local ranks {first % count} and {first} "
        f"would share GPU {first % count}; ask Slurm for one GPU per rank (--gpus-per-task=1, or "
        "--ntasks-per-node equal to --gpus-per-node), or start fewer ranks per node"
    )


def route_ifname(addr: str) -> str | None:
    """The network interface that routes to ``addr`` (a name or IP); None if unknown or ``lo``."""
    ip_tool = shutil.which("ip")
    if ip_tool is None:
        return None
    try:
        ip = socket.gethostbyname(addr)
        out = subprocess.run(
            [ip_tool, "-o", "route", "get", ip], capture_output=True, text=True, timeout=5, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\bdev\s+(\S+)", out)
    return match[1] if match and match[1] != "lo" else None


def _is_loopback(host: str) -> bool:
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def fix_loopback_ifname(env: DistEnv, environ: MutableMapping[str, str]) -> str | None:
    """Point gloo at the real interface when this host's name means loopback.

    Gloo advertises the address its host name resolves to; where /etc/hosts maps the name to
    127.0.x.1 (common in containers and on some clusters) peers then dial 127.0.0.1 and fail
    with "connectFullMesh ... Connection refused". Sets GLOO_SOCKET_IFNAME in ``environ`` (gloo
    takes it as the exact name of one interface); never overrides the user's value. On the rendezvous
    node itself MASTER_ADDR (its own name) resolves to loopback too: there the interface is the one
    that routes to another node of the job (``_peer_address``); a job on one node keeps loopback,
    which is right for it. Returns the interface set, or None.

    NCCL_SOCKET_IFNAME is left alone: NCCL chooses its interfaces itself (never ``lo`` while
    another exists, InfiniBand first), whatever the host name resolves to, and it reads that
    variable as a prefix (``eth1`` also matches ``eth10``), which could pin its bootstrap to the
    wrong card.
    """
    if not env.is_distributed or environ.get("GLOO_SOCKET_IFNAME"):
        return None
    hostname = socket.gethostname()
    if not _is_loopback(hostname):
        return None
    target: str | None = env.master_addr
    if _is_loopback(env.master_addr):  # this is the rendezvous node (or a single-node job)
        target = _peer_address(env, environ, hostname) if env.num_nodes > 1 else None
        if target is None and env.num_nodes > 1:
            log.warning(
                "host name %s resolves to loopback and no other node of the job was found to "
                "route to: set GLOO_SOCKET_IFNAME if the ranks cannot connect",
                hostname,
            )
        if target is None:
            return None
    ifname = route_ifname(target)
    if ifname is None:
        log.warning(
            "host name %s resolves to loopback and no interface routes to %s: "
            "set GLOO_SOCKET_IFNAME if the ranks cannot connect",
            hostname,
            target,
        )
        return None
    environ["GLOO_SOCKET_IFNAME"] = ifname
    log.info(
        "host name %s resolves to loopback: set GLOO_SOCKET_IFNAME=%s (the interface routing "
        "to %s) so peers do not dial 127.0.0.1",
        hostname,
        ifname,
        target,
    )
    return ifname


def _peer_address(env: DistEnv, environ: Mapping[str, str], hostname: str) -> str | None:
    """A node of this job other than this one that resolves to a real address (Slurm's node list)."""
    from ddp_slurm.distributed.env import expand_hostlist

    text = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not text:
        return None
    try:
        hosts = expand_hostlist(text)
    except BootstrapError:
        return None
    short = hostname.split(".")[0]
    for host in hosts:
        if host.split(".")[0] != short and not _is_loopback(host):
            return host
    return None


def _rendezvous_error(env: DistEnv, timeout_s: float, exc: Exception) -> RendezvousError:
    """Turn torch's multi-line store and NCCL errors into one line that says what to do."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    where = f"rank {env.rank}: rendezvous at {env.master_addr}:{env.master_port}"
    if "NCCL" in text and len(lines) > 1:
        return _nccl_error(where, text, lines[-1])
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return RendezvousError(
            f"{where} failed: port {env.master_port} is already in use on "
            f"{env.master_addr}; set MASTER_PORT to a free port, e.g. "
            "`MASTER_PORT=29613`"
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        return RendezvousError(
            f"{where} timed out after {timeout_s:g} s: expected {env.world_size} ranks, {joined[1]} arrived"
        )
    if "timed out" in text.lower() or "timeout" in text.lower():
        return RendezvousError(
            f"{where} timed out after {timeout_s:g} s: could not reach rank 0 "
            f"(expected {env.world_size} ranks); check that rank 0 started and "
            "that every rank has the same MASTER_ADDR and MASTER_PORT"
        )
    if "connectFullMesh" in text or "Connection refused" in text:
        return RendezvousError(
            f"{where}: the ranks met but could not connect to each other "
            f"({text}); set GLOO_SOCKET_IFNAME to the network interface "
            "the nodes share"
        )
    return RendezvousError(f"{where} (expected {env.world_size} ranks) failed: {text}")


def _nccl_error(where: str, first: str, last: str) -> RendezvousError:
    """NCCL says what went wrong on its last line ("Last error: ..."); the first only names its source file."""
    duplicate = re.search(r"rank (\d+) and rank (\d+) both on CUDA device (\w+)", last)
    if duplicate:
        return RendezvousError(
            f"{where}: ranks {duplicate[2]} and {duplicate[1]} share one GPU (bus id {duplicate[3]}), which NCCL "
            "refuses; give every rank its own GPU (--gpus-per-task=1, or --ntasks-per-node equal to "
            f"--gpus-per-node). NCCL: {last}"
        )
    gist = re.sub(r"^NCCL error in: \S+:\d+,\s*", "", first)
    return RendezvousError(f"{where}: NCCL could not set up its communicator ({gist}): {last}")


def init_distributed(
    env: DistEnv, backend: str = "auto", timeout_s: float = 300.0, stopped: Callable[[], bool] | None = None
) -> tuple[torch.device, str]:
    """Join the process group described by ``env``; returns (device, backend).

    Configures threads and malloc, picks the device and backend, fixes the gloo interface, then calls
    ``init_process_group``. ``timeout_s`` bounds the rendezvous (every rank gives up within it plus
    ``meet.MARGIN_S``, whatever holds the port) and, as in torch, collectives. ``stopped()`` true while
    waiting for the other ranks: ``meet.RendezvousStopped``.
    One process uses an in-process store and needs no port. Raises :class:`BootstrapError`
    or :class:`RendezvousError` with a one-line message.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise BootstrapError("torch.distributed is already initialized: call shutdown() first")
    if env.is_distributed:
        try:  # fail fast: torch would retry an unresolvable name until the timeout
            socket.getaddrinfo(env.master_addr, env.master_port)
        except OSError as exc:
            raise BootstrapError(
                f"MASTER_ADDR={env.master_addr!r} cannot be resolved ({exc.strerror or exc})"
            ) from None
    threads = configure_threads(env, os.environ)
    if env.rank == 0 and env.launcher != "slurm" and not os.environ.get("OMP_NUM_THREADS") and threads > 4:
        # every CPU this process may use: right on a node of one's own, slow on a shared one (a login node's
        # neighbours made the README's first run 7x slower); say so where a user can act on it
        log.info(
            "%d threads per rank (the CPUs this process may use, over %d local rank(s)); on a shared machine "
            "set OMP_NUM_THREADS to a few",
            threads,
            env.local_world_size,
        )
    hostmem.keep_freed_memory(os.environ)  # no page faults on every CPU step (see hostmem)
    gpus_per_task = bound_gpus_per_task(env.launcher, os.environ)
    device, backend = pick_device_and_backend(backend, env.local_rank, env.local_world_size, gpus_per_task)
    fix_loopback_ifname(env, os.environ)
    timeout = timedelta(seconds=timeout_s)
    device_id = device if backend == "nccl" else None  # binds NCCL's communicator eagerly
    made_with = groups.default_backend(backend)  # the test mode's NCCL-shaped gloo (see groups.py)
    if not env.is_distributed:
        dist.init_process_group(
            made_with,
            store=dist.HashStore(),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device_id,
        )
        return device, backend
    try:
        # Our own store (rdzv.job_store): bound to the rendezvous address only and keyed by a per-job
        # secret, so that nobody outside the job can join it or plant keys; it connects to torchrun's
        # agent store where TORCHELASTIC_USE_AGENT_STORE says so, as torch's tcp:// would.
        store = rdzv.job_store(env, timeout, os.environ, stopped)
        dist.init_process_group(
            made_with, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, device_id=device_id
        )
    except RendezvousError:  # worded already (meet)
        raise
    except (RuntimeError, ValueError) as exc:  # DistError subclasses RuntimeError
        raise _rendezvous_error(env, timeout_s, exc) from exc
    log.info(
        "rank %d/%d joined %s process group at %s:%d on %s",
        env.rank,
        env.world_size,
        backend if made_with == backend else f"{backend} ({made_with}, the NCCL-shaped test mode)",
        env.master_addr,
        env.master_port,
        device,
    )
    return device, backend


def shutdown(abort: bool = False) -> None:
    """Leave the default process group if there is one; safe to call twice.

    ``abort=True`` is for error paths: NCCL's orderly destroy waits for its communicators' pending
    work, which never finishes when a peer has died or hangs, while abort cancels it. A torch
    without ``_abort_process_group`` (or a backend that refuses it) gets the orderly destroy; gloo's
    does not wait for peers, so that is safe there.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if abort:
        from torch.distributed import distributed_c10d

        abort_group = getattr(distributed_c10d, "_abort_process_group", None)
        if abort_group is not None:
            try:
                abort_group()
                return
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                log.debug("abort of the process group failed (%s): destroying it instead", exc)
        if not dist.is_initialized():
            return
    dist.destroy_process_group()


@contextlib.contextmanager
def distributed(
    env: DistEnv, backend: str = "auto", timeout_s: float = 300.0, stopped: Callable[[], bool] | None = None
) -> Iterator[tuple[torch.device, str]]:
    """``with distributed(env) as (device, backend):`` — always leaves the group on exit: destroyed
    after a normal exit, aborted when the body raised (see :func:`shutdown`)."""
    try:
        yield init_distributed(env, backend, timeout_s, stopped)
    except BaseException:
        shutdown(abort=True)
        raise
    else:
        shutdown()


def on_rank0(env: DistEnv, fn: Callable[[], Any], group: Any) -> Any:
    """Run ``fn`` on rank 0 and hand its result (or its exception) to every rank.

    The result travels pickled through ``group``, the host group (``groups.Groups.host``): keep it small
    (a path, not a checkpoint).
    """
    import torch.distributed as dist

    result: list[Any] = [None]
    if env.rank == 0:
        try:
            result[0] = ("ok", fn())
        except Exception as exc:  # re-raised on every rank below, so all exit the same way
            result[0] = ("error", exc)
    if env.world_size > 1:
        dist.broadcast_object_list(result, src=0, group=group)
    status, value = result[0]
    if status == "error":
        raise value
    return value
