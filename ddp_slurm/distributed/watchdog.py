"""Name the rank that went missing when a collective fails.

When a rank dies (SIGKILL, the OOM killer, a crashed node), the survivors only hear from gloo or
NCCL: "Connection closed by peer [10.0.0.12]:41723", or a timeout. Neither names a rank. So every
rank runs a daemon thread that stamps ``hb/<rank>`` in the rendezvous store (the TCPStore at
MASTER_ADDR:MASTER_PORT that every rank reached at start-up) every ``interval_s`` seconds, over its
own connection. When training raises, one survivor (the first to ask) reads all stamps twice,
``grace_s`` apart, and publishes a verdict in the store: a rank whose stamp did not move is lost;
the other survivors wait for that verdict instead of scanning too, so a failure costs O(world size)
store operations, not O(world size squared). If the store itself cannot be reached, its host is
what went missing: rank 0 (srun, manual launches) or the torchrun agent.

The heartbeat thread also looks for a published verdict, so a rank whose training thread is still
blocked in a collective learns it within one interval; when that collective fails later (perhaps
only because rank 0, the store's host, has exited meanwhile), the rank reports the real cause, and
rank 0 need keep the store up only until every survivor has seen the verdict.

With NCCL the failure path above never runs for a lost or frozen rank: NCCL's own watchdog ends
the process at ``dist.timeout_s`` while the training thread waits on the GPU. So a rank that has
made no progress (``Watchdog.progress``, the step it is in) for a few seconds looks for the cause
itself, from the heartbeat thread: see ``distributed/stall.py``. A verdict published that way is also
the diagnosis of a rank whose collective fails later (the ranks leaving on it close their sockets, and
a scan would find them silent too); a rank whose own heartbeat stood still for ``grace_s`` (it was
frozen, then continued) names nobody: the others have named it.

Cost while training: one tiny store write and one existence check per rank per ``interval_s``, off
the training thread. On the failure path everything is bounded (about ``grace_s`` + ``2 *
op_timeout_s``), so a dead peer never turns into a hang here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from ddp_slurm import errors
from ddp_slurm.distributed import flightrec, rdzv

log = logging.getLogger(__name__)

ENDED = "ended"  # the heartbeat value of a rank that left on its own (it saw the failure too)


class PeerLost(errors.Error):
    """One or more ranks (or the store's host) vanished; the message names them. One line."""


class Watchdog:
    """Heartbeat for this rank plus the failure diagnosis. Use :func:`watch` rather than this directly."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        store_addr: str,
        agent_store: bool = False,
        interval_s: float = 1.0,
        grace_s: float = 5.0,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.store_addr = store_addr  # host:port, for messages
        self.agent_store = agent_store  # torchrun's agent runs the store, not rank 0
        self.hosts_store = rank == 0 and not agent_store  # this process runs the store: it must outlive the diagnosis
        self.interval_s, self.grace_s = interval_s, grace_s
        self._lock = threading.Lock()  # one connection, two threads
        self._stop = threading.Event()
        self._seq = 0
        self._beat_at = 0.0  # monotonic time of the last beat (0: none yet)
        self.gap = 0.0  # the longest time between two beats: a process stopped (SIGSTOP) and continued shows it
        self._rank0: str | None = None  # "host pid" of rank 0, for the message when its store is gone
        # A verdict published by another rank, picked up by this rank's heartbeat thread even while
        # its training thread is still blocked in a collective: when that one fails later, maybe
        # after the store's host has exited, the real cause is already known.
        self._seen: tuple[int, str] | None = None
        self._progress = -1  # the step the training thread last reported (-1: none yet), in the heartbeat
        self.moved = time.monotonic()  # when it last changed
        self.failing = False  # the training thread is diagnosing a failure itself (explain)
        self._op_since = 0.0  # monotonic start of the store operation under way (0: none)
        self.store_gone = False  # its host does not answer (an operation blocked): nothing more is asked of it
        self.after_beat: Callable[[], None] | None = None  # run on the heartbeat thread after each beat
        self._thread = threading.Thread(target=self._beat_forever, name="ddp_slurm-heartbeat", daemon=True)

    # -- heartbeat ------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        self._op("set", f"info/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._beat()
        if self.rank != 0:
            self._learn_rank0(wait_s=2.0)
        self._thread.start()
        return self

    def _learn_rank0(self, wait_s: float) -> None:
        """Rank 0's host and pid, read now, while its store lives: a rank 0 killed within the first heartbeat
        interval took its store along, and the survivor could name it only by the store's address."""
        deadline = time.monotonic() + wait_s
        while self._rank0 is None:
            if self._op("check", ["info/0"]):
                self._rank0 = self._op("get", "info/0").decode()
            elif time.monotonic() >= deadline:
                return  # rank 0 starts its watchdog late (or not at all): the heartbeat thread keeps looking
            else:
                time.sleep(0.02)

    def progress(self, step: int) -> None:
        """Called by the training thread at every step: the heartbeat then tells where this rank is."""
        if step != self._progress:
            self._progress, self.moved = step, time.monotonic()

    def _beat(self) -> None:
        now = time.monotonic()
        if self._beat_at:
            self.gap = max(self.gap, now - self._beat_at)
        self._beat_at = now
        self._seq += 1
        self._op("set", f"hb/{self.rank}", f"{self._seq} {time.time():.3f} {self._progress}")

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                if self._rank0 is None and self.rank != 0 and self._op("check", ["info/0"]):
                    self._rank0 = self._op("get", "info/0").decode()
                if self._seen is None and self._op("check", ["verdict"]):
                    count, _, text = self._op("get", "verdict").decode().partition("\t")
                    self._seen = int(count), text
                    self._op("add", "seen", 1)
                if self.after_beat is not None:
                    self.after_beat()
            except Exception as exc:  # the store is gone: the diagnosis will say so; don't spam the log
                log.debug("heartbeat stopped: %s", exc)
                return

    def stop(self) -> None:
        """Stop beating and mark this rank as ended (not lost)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)
        with contextlib.suppress(Exception):
            self._op("set", f"hb/{self.rank}", ENDED)

    def _op(self, name: str, *args: Any) -> Any:
        with self._lock:
            self._op_since = time.monotonic()
            try:
                return getattr(self.store, name)(*args)
            finally:
                self._op_since = 0.0

    def op_blocked_s(self) -> float:
        """How long the store operation under way has waited (0: none). A store whose host froze or vanished
        without closing its socket never answers: some operations then wait past their own timeout, for good."""
        since = self._op_since
        return time.monotonic() - since if since else 0.0

    # -- diagnosis ------------------------------------------------------------------------------
    def _read(self, ranks: list[int]) -> dict[int, str | None]:
        """Each rank's heartbeat value (None: never written). Raises if the store is unreachable."""
        out: dict[int, str | None] = {}
        for r in ranks:
            key = f"hb/{r}"
            out[r] = self._op("get", key).decode() if self._op("check", [key]) else None
        return out

    def _scan(self) -> list[tuple[int, str, str]]:
        """``(rank, where, how long silent)`` for every other rank whose heartbeat did not move within ``grace_s``."""
        others = [r for r in range(self.world_size) if r != self.rank]
        first = self._read(others)
        alive = {r for r, v in first.items() if v == ENDED}
        deadline = time.monotonic() + self.grace_s
        while len(alive) < len(others) and time.monotonic() < deadline:
            time.sleep(min(self.interval_s / 2, max(deadline - time.monotonic(), 0)))
            now = self._read([r for r in others if r not in alive])
            alive |= {r for r, v in now.items() if v != first[r]}
        lost = []
        for r in others:
            if r in alive:
                continue
            info = self._op("get", f"info/{r}").decode().split() if self._op("check", [f"info/{r}"]) else []
            where = f"host {info[0]}, pid {info[1]}" if len(info) == 2 else "host unknown"
            stamp = first[r]
            silent = (
                f"no heartbeat for {time.time() - float(stamp.split()[1]):.0f} s" if stamp else "no heartbeat at all"
            )
            lost.append((r, where, silent))
        return lost

    @staticmethod
    def _describe(lost: list[tuple[int, str, str]]) -> str:
        """``lost rank 1 (host node2, pid 4711): no heartbeat for 7 s`` (or ``lost ranks 1 (...), 3 (...)``)."""
        if len(lost) == 1:
            return "lost rank {} ({}): {}".format(*lost[0])
        return "lost ranks " + ", ".join(f"{r} ({where}; {silent})" for r, where, silent in lost) if lost else ""

    def _verdict(self) -> tuple[int, str]:
        """How many ranks were lost, and the shared description of them ("" if every rank is alive)."""
        if self._seen is not None:
            return self._seen
        if self._op("check", ["verdict"]):  # published (by a stall check) before this rank's heartbeat read it:
            count, _, text = self._op("get", "verdict").decode().partition("\t")  # the ranks that left on it
            return int(count), text  # are silent now, and a scan of its own would name them too
        if self._op("add", "diagnosing", 1) == 1:  # the first survivor scans; the others read its verdict
            lost = self._scan()
            self._op("set", "verdict", f"{len(lost)}\t{self._describe(lost)}")
            return len(lost), self._describe(lost)
        # Poll rather than store.wait(): a blocking wait would hold the connection's lock, and with it
        # this rank's heartbeat, so that the scanning rank would count this one as lost too.
        deadline = time.monotonic() + self.grace_s + 2 * self.interval_s + 5
        while not self._op("check", ["verdict"]):
            if time.monotonic() > deadline:  # the scanning rank died or hung: scan here instead
                lost = self._scan()
                return len(lost), self._describe(lost)
            time.sleep(0.2)
        count, _, text = self._op("get", "verdict").decode().partition("\t")
        return int(count), text

    def explain(self, exc: BaseException) -> tuple[PeerLost, int] | None:
        """``(PeerLost naming the vanished ranks, how many)``, or None if every rank is alive (then
        ``exc`` tells the story by itself)."""
        self.failing = True
        cause = _first_line(exc)
        frozen = self.frozen_s()
        if frozen >= self.grace_s:  # the others went on without this rank: whoever it would name left on its verdict
            return PeerLost(
                f"this rank was frozen for {frozen:.0f} s, its heartbeat too (SIGSTOP, a frozen node, a hung device): "
                f"the other ranks have named it lost and left; its collective failed with: {cause}"
            ), 0
        try:
            count, verdict = self._verdict()
        except Exception as store_exc:  # the store's host is gone, and with it (at least) that process
            if self._seen is not None and self._seen[0]:  # it left after the verdict: that is the story
                return PeerLost(f"{self._seen[1]}; this rank's collective failed with: {cause}"), self._seen[0]
            return PeerLost(
                f"lost {self._store_owner()}: the rendezvous store it hosted is unreachable "
                f"({_first_line(store_exc)}); this rank's collective failed with: {cause}"
            ), 1
        if not count:
            return None
        return PeerLost(f"{verdict}; this rank's collective failed with: {cause}"), count

    def frozen_s(self) -> float:
        """How long this process's heartbeat once stood still (a stopped and continued process), the time since its
        last beat included while the heartbeat thread lives (it may not have beaten yet since it was continued)."""
        pending = time.monotonic() - self._beat_at if self._beat_at and self._thread.is_alive() else 0.0
        return max(self.gap, pending)

    def _store_owner(self) -> str:
        if self.agent_store:
            return f"the torchrun agent at {self.store_addr}"
        host, _, pid = (self._rank0 or "").partition(" ")
        return (
            f"rank 0 (host {host}, pid {pid}, store at {self.store_addr})" if pid else f"rank 0 (at {self.store_addr})"
        )

    def linger(self, lost: int) -> None:
        """Stay until every survivor's heartbeat has picked up the verdict (about one heartbeat interval;
        bounded): on the store's host, to keep the store up; on a rank the stall check ends, so that no survivor
        sees its collective fail (this rank's sockets closing) before it knows why."""
        if self.store_gone:
            return
        survivors = self.world_size - lost
        deadline = time.monotonic() + 4 * self.interval_s + 5
        with contextlib.suppress(Exception):
            while self._op("add", "seen", 0) < survivors and time.monotonic() < deadline:
                time.sleep(0.1)


def _first_line(exc: BaseException) -> str:
    """The gist of a torch/gloo error: first line, without the C++ source location or gloo's boilerplate."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text.splitlines()[0])
    return text.split(". This is typically caused by")[0]


def _store_client(env: Any, timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        env.master_addr, env.master_port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


@contextlib.contextmanager
def watch(
    env: Any,
    ignore: tuple[type[BaseException], ...] = (),
    op_timeout_s: float = 5.0,
    after_beat: Callable[[Watchdog], Callable[[], None]] | None = None,
) -> Iterator[Watchdog | None]:
    """Heartbeat while the block runs; an exception not in ``ignore`` that a lost rank explains is
    re-raised as :class:`PeerLost` (chained to the original). No-op for a single process.

    ``after_beat(dog)`` builds what runs after each heartbeat, on the heartbeat thread: ``stall.checker``
    (a rank whose reported progress has not moved for a deadline looks for a lost or stuck rank
    itself). The training thread must then call ``progress(step)`` on the yielded watchdog every step.
    Passed in rather than imported: the stall check builds on this module, not the other way round.

    Call inside the process group's lifetime: the store at MASTER_ADDR:MASTER_PORT is up then.
    """
    if env.world_size <= 1:
        yield None
        return
    from torch.distributed import PrefixStore

    from ddp_slurm.distributed import group

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun restarts reuse the agent's store
    try:
        secret = rdzv.job_secret(env, os.environ)  # the job's own keys: nobody outside can fake a heartbeat
        store = PrefixStore(f"{secret}/ddp_slurm/watchdog/{attempt}/", _store_client(env, op_timeout_s))
        dog = Watchdog(store, env.rank, env.world_size, f"{env.master_addr}:{env.master_port}", agent_store)
        if after_beat is not None:
            dog.after_beat = after_beat(dog)  # built on the training thread: StallCheck reports its place
        dog.start()
    except Exception as exc:  # a diagnosis aid must never stop a healthy run
        log.warning("heartbeat off (a lost rank will not be named): %s", _first_line(exc))
        yield None
        return
    try:
        yield dog
    except ignore:
        raise
    except Exception as exc:
        found = dog.explain(exc)
        if found is None:
            raise
        error, count = found
        if count:  # the flight-recorder file the batch scripts promise, as on the stall check's path
            flightrec.dump(dog.rank, {"verdict": str(error).split("; ")[0], "step": dog._progress, "cause": str(exc)})
        if dog.hosts_store:
            # Close our collectives first, so ranks still blocked on us fail now and come for the verdict.
            with contextlib.suppress(Exception):  # abort: NCCL's orderly destroy can wait forever for the lost rank
                group.shutdown(abort=True)
            dog.linger(lost=count)
        raise error from exc
    finally:
        dog.stop()
