"""Meeting the other ranks at the rendezvous: bounded in time, interruptible by a stop signal, one line
when it fails.

torch's store calls block in C++: a rank whose ``MASTER_PORT`` is held by another program (a web server,
a stale process) connects to it and waits for an answer that never comes, for minutes, and no Python
signal handler runs meanwhile, so SIGTERM from Slurm or torchrun is ignored too. Here the store is
built and the ranks meet in a helper thread; the rank's own thread waits for it at most
``dist.timeout_s`` + ``MARGIN_S``, polling the stop flag (a stop signal ends the wait within
``STOP_GRACE_S``: exit 75, nothing started), and then says what it found:

* nothing answered as a store: "could not reach rank 0", or, when something accepts connections on
  the port, that another program holds it;
* rank 0's store answered, but the ranks did not meet under the job's secret key prefix (``rdzv``): a
  ``DDP_SLURM_SECRET`` (or rendezvous key) that differs between ranks;
* fewer ranks than expected arrived.

The meeting is a count under the secret prefix: each rank adds one, the last sets ``ready``. A thread
left blocked in C++ after the deadline is a daemon: the rank exits anyway.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ddp_slurm import errors
from ddp_slurm.distributed.env import DistEnv, RendezvousError

MARGIN_S = 5.0  # beyond dist.timeout_s: torch's own timeout errors (more precise) come first
HOSTED = "ddp_slurm/rdzv/hosted"  # outside the secret prefix: says only that rank 0's store is up
SECRET_HINT = "DDP_SLURM_SECRET"
# A stop signal while the ranks meet: if they still meet within this, training starts and the loop's
# stop vote makes it a clean stop with a step-0 checkpoint (signals during start-up); if not, the rank
# gives up waiting and exits 75 with nothing saved (Slurm's KillWait and torchrun's grace are 30 s).
STOP_GRACE_S = 5.0


class RendezvousStopped(errors.Stopped):
    """A stop signal came while this rank waited for the others: nothing was started, nothing to save."""


def keys(environ: Mapping[str, str]) -> tuple[str, str]:
    """The meeting's keys (under the secret prefix), per torchrun restart: the agent's store outlives one."""
    round_ = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"rdzv/{round_}/arrived", f"rdzv/{round_}/ready"


def meet(
    env: DistEnv,
    timeout_s: float,
    environ: Mapping[str, str],
    connect: Callable[[], Any],
    prefixed: Callable[[Any], Any],
    hosting: bool,
    stopped: Callable[[], bool] | None = None,
) -> Any:
    """``connect()`` (the raw store; blocks) and meet every rank under ``prefixed(store)``; returns the
    prefixed store. Raises RuntimeError from torch as it came (the caller words it), RendezvousError at
    the deadline, RendezvousStopped on a stop signal."""
    arrived_key, ready_key = keys(environ)
    seen: dict[str, Any] = {}
    cancel = threading.Event()

    def run() -> None:
        try:
            store = connect()
            seen["connected"] = True
            mine = prefixed(store)
            count = mine.add(arrived_key, 1)
            if count >= env.world_size:
                mine.set(ready_key, "1")
            if hosting:
                store.set(HOSTED, "1")
            pause, last_look = 0.005, 0.0
            while not mine.check([ready_key]):
                if cancel.wait(pause):
                    return
                pause = min(pause * 2, 0.2)
                if time.monotonic() - last_look > 1.0:  # for the diagnosis at the deadline; cheap on the store
                    seen["arrived"], seen["hosted"] = int(mine.add(arrived_key, 0)), store.check([HOSTED])
                    last_look = time.monotonic()
            seen["store"] = mine
        except BaseException as exc:  # handed to the rank's thread, which raises it
            seen["error"] = exc

    thread = threading.Thread(target=run, name="ddp-slurm-rendezvous", daemon=True)
    thread.start()
    deadline, stop_by = time.monotonic() + timeout_s + MARGIN_S, None
    try:
        while thread.is_alive():
            if stop_by is None and stopped is not None and stopped():
                stop_by = time.monotonic() + STOP_GRACE_S
            if stop_by is not None and time.monotonic() > stop_by:
                raise RendezvousStopped(
                    f"rank {env.rank}: stop signal while waiting for the other ranks at {env.master_addr}:"
                    f"{env.master_port}: nothing was started or saved; launch again to resume"
                )
            if time.monotonic() > deadline:
                raise RendezvousError(_why(env, timeout_s, seen, hosting))
            thread.join(0.05)  # signal handlers run between these waits
    finally:
        cancel.set()
    if "error" in seen:
        # rank 0 gave up first (a secret that differs, or ranks that never came) and its store went away:
        # what this rank saw before that is the cause, not the connection torch then lost
        short = not hosting and seen.get("connected") and 0 < seen.get("arrived", 0) < env.world_size
        if _mismatched(seen, hosting) or short:
            raise RendezvousError(_why(env, timeout_s, seen, hosting))
        raise seen["error"]
    return seen["store"]


def _why(env: DistEnv, timeout_s: float, seen: Mapping[str, Any], hosting: bool) -> str:
    where = f"rank {env.rank}: rendezvous at {env.master_addr}:{env.master_port} timed out after {timeout_s:g} s"
    secret = (
        f"every rank of a job needs the same {SECRET_HINT} (unset: the same rendezvous key, "
        "~/.config/ddp_slurm/rendezvous.key, on a home directory the nodes share)"
    )
    if not seen.get("connected"):
        if env.rank != 0 and _accepts(env.master_addr, env.master_port):
            return (
                f"{where}: something accepts connections on port {env.master_port} but does not answer as rank 0's "
                f"rendezvous store (another program holds the port?); set MASTER_PORT to a free port for every rank"
            )
        return (
            f"{where}: could not reach rank 0 (expected {env.world_size} ranks); check that rank 0 started and "
            "that every rank has the same MASTER_ADDR and MASTER_PORT"
        )
    arrived = seen.get("arrived", 1)
    if hosting and arrived < env.world_size:  # the store saw every rank connect, fewer met under the secret
        return (
            f"{where}: expected {env.world_size} ranks, {arrived} arrived with this job's secret while "
            f"{env.world_size} connected: a rank with another {SECRET_HINT}, or another program connected; {secret}"
        )
    if _mismatched(seen, hosting):
        return f"{where}: rank 0's store answered, but not under this rank's secret: {SECRET_HINT} differs; {secret}"
    return f"{where}: expected {env.world_size} ranks, {arrived} arrived"


def _mismatched(seen: Mapping[str, Any], hosting: bool) -> bool:
    """A rank other than the host saw rank 0's store up but met nobody under its own secret."""
    return not hosting and bool(seen.get("hosted")) and seen.get("arrived", 1) <= 1


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False
