"""Name a lost or stuck rank, record it and end, before the backend's own timeout ends every process without a word.

With NCCL, a rank that dies or freezes, or a node that vanishes without closing its sockets (a power
loss, a cut link), leaves the others waiting inside a collective on the GPU; NCCL's watchdog
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default) then kills each process at ``dist.timeout_s``, so no
exception ever reaches ``watchdog.watch`` and nobody says which rank it was. gloo waits the same way
when no RST arrives. This check runs on every rank's heartbeat thread instead, independent of the backend:

* a rank whose training thread has reported no new step (``Watchdog.progress``) for ``LOOK_S`` (3 s)
  asks to look for a lost rank; one rank at a time looks (a counter in the store elects it), so a
  job-wide wait costs O(world size) store reads per look, not O(world size squared);
* it reads every heartbeat twice, ``grace_s`` apart: a heartbeat that did not move is a lost rank
  (dead process, crashed, frozen or vanished node: ``SIGSTOP`` stops its heartbeat thread too). That
  verdict does not depend on how long a step may take, so it comes within seconds (``LOOK_S`` +
  ``grace_s``), whatever ``dist.timeout_s`` and Slurm's node timeout are;
* only once the wait reaches ``stall_s`` (shorter than ``dist.timeout_s``: :func:`deadline_s`) does a
  heartbeat that moves while its step stays behind the furthest rank's count as a stuck rank (its
  process lives, its training thread does not come back: a GPU hang, a deadlock): a long checkpoint on
  one rank looks the same for a while;
* it publishes the verdict in the store, where every other rank's heartbeat picks it up; each rank that
  is waiting then, in this order: records the lost hosts (``before_exit``: ``lost_nodes``, so that the
  supervisor relaunches without them, or the job is requeued without them), writes its flight-recorder
  file (``flightrec``: what NCCL's watchdog would have dumped), and ends with the one-line
  :class:`~ddp_slurm.distributed.watchdog.PeerLost` error (``os._exit``: its training thread is blocked
  inside the backend);
* the store's own host (rank 0 under srun, the torchrun agent) frozen or vanished: every store operation
  then blocks, the heartbeat's too, past its timeout. A sentinel thread per rank sees the heartbeat's
  operation wait ``STORE_LOST_S`` while training does not move, and ends the rank the same way, naming rank 0
  (its host read at start-up); under the project's batch scripts that host usually runs the supervisor too,
  so the record requeues the job without it (``chain.after_peer_lost``).

A rank that hangs inside a step (a GPU hang in its forward) reports the same step as the ranks
waiting for it inside that step's all-reduce. So while it waits, each rank also publishes where its
training thread stands (file, line, function); when nobody is lost or behind but the ranks stand in
different places, the look logs a warning naming the odd ones out and their place, and leaves the
ending to the backend's timeout: a long checkpoint on rank 0 looks the same, and is not an error.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from ddp_slurm.distributed import flightrec
from ddp_slurm.distributed.watchdog import ENDED, PeerLost, Watchdog
from ddp_slurm.exitcodes import EXIT_FAILURE

log = logging.getLogger(__name__)

LEAD = "stall/lead"  # store counter: the rank that brings it to 1 looks; reset to 0 when it found nobody
AT = "stall/at/"  # + rank: where that rank's training thread stands, published while it waits
LOOK_S = 3.0  # no progress for this long: look for a lost rank (a dead heartbeat is a verdict whatever a step takes)
STORE_LOST_S = 8.0  # a store operation waiting this long (its own timeout is 5 s): the store's host is gone


def deadline_s(timeout_s: float) -> float:
    """How long a rank may see no progress before looking for the cause: well inside ``dist.timeout_s``
    (NCCL's timeout), leaving the look (``grace_s``, 5 s) and the other ranks' pick-up time to finish first."""
    return timeout_s / 2 if timeout_s < 60 else timeout_s - 30


def _step(value: str | None) -> int | None:
    """The step in a heartbeat value ``"seq time step"``; None for an old-format or missing one."""
    parts = (value or "").split()
    return int(parts[2]) if len(parts) == 3 else None


def find_stuck(dog: Watchdog, stuck: bool = True, seen: dict[int, str | None] | None = None) -> list[str]:
    """One phrase per lost or (with ``stuck``) stuck rank (this one included when it is the one behind), by
    rank. ``seen``: filled with each other rank's heartbeat as last read (for the flight-recorder file)."""
    others = [r for r in range(dog.world_size) if r != dog.rank]
    first = dog._read(others)
    deadline = time.monotonic() + dog.grace_s
    while time.monotonic() < deadline:  # keep this rank's own heartbeat going meanwhile
        time.sleep(min(dog.interval_s, max(deadline - time.monotonic(), 0)))
        dog._beat()
    second = dog._read(others)
    if seen is not None:
        seen.update(second)
    steps = {r: _step(v) for r, v in second.items() if v != ENDED}
    steps[dog.rank] = dog._progress
    furthest = max((s for s in steps.values() if s is not None), default=-1)
    found = []
    for r in sorted(steps):
        if r != dog.rank and second[r] is None:
            found.append(f"lost rank {r} ({_where(dog, r)}): no heartbeat at all")
        elif r != dog.rank and second[r] == first[r]:
            found.append(f"lost rank {r} ({_where(dog, r)}): no heartbeat for {_silent(second[r])}")
        elif stuck and steps[r] is not None and steps[r] < furthest and (r == dog.rank or _step(first[r]) == steps[r]):
            found.append(
                f"stuck rank {r} ({_where(dog, r)}): at step {steps[r]} while others reached step {furthest}; "
                "its process is alive but its training does not come back (a GPU hang or a deadlock)"
            )
    return found


def _where(dog: Watchdog, rank: int) -> str:
    if rank == dog.rank:
        import socket

        return f"host {socket.gethostname()}, pid {os.getpid()}, this rank"
    key = f"info/{rank}"
    info = dog._op("get", key).decode().split() if dog._op("check", [key]) else []
    return f"host {info[0]}, pid {info[1]}" if len(info) == 2 else "host unknown"


def _silent(stamp: str) -> str:
    try:
        return f"{time.time() - float(stamp.split()[1]):.0f} s"
    except (IndexError, ValueError):
        return "a while"


def exit_on_lost(dog: Watchdog) -> Callable[[PeerLost, int], None]:
    """The default ``on_lost`` (the record and the dump are done by then): log the line, wait until the others
    have read the verdict, exit 1."""

    def act(error: PeerLost, lost: int) -> None:
        log.error("%s", error)
        # Every rank, not only the store's host: until the others have read the verdict, none of them may see its
        # collective fail because this one's sockets closed (gloo raises, NCCL's watchdog aborts), and end without
        # the record and the dump (bounded: about one heartbeat interval, 9 s at most).
        dog.linger(lost)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILURE)  # the training thread is blocked inside the backend: no other way out

    return act


def thread_at(thread_id: int | None) -> str:
    """``window.py:78 in close (torch: all_reduce)``: where a thread's Python code stands (the innermost
    frame outside torch, and the torch function it is inside, if any); "" if the thread is gone."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return ""
    inner, torch_dir = frame, f"{os.sep}torch{os.sep}"
    while frame is not None and torch_dir in frame.f_code.co_filename:
        frame = frame.f_back
    own = frame or inner
    text = f"{Path(own.f_code.co_filename).name}:{own.f_lineno} in {own.f_code.co_name}"
    return text + (f" (torch: {inner.f_code.co_name})" if inner is not own else "")


def checker(
    stall_s: float,
    on_lost: Callable[[PeerLost, int], None] | None = None,
    before_exit: Callable[[PeerLost], None] | None = None,
) -> Callable[[Watchdog], StallCheck]:
    """``watchdog.watch(env, after_beat=checker(deadline_s(timeout), before_exit=record))``: a StallCheck for
    the watchdog ``watch`` starts. When it finds a lost or stuck rank, on the heartbeat thread:
    ``before_exit(error)`` (record the lost hosts: ``chain.after_peer_lost``), the flight-recorder file, then
    ``on_lost(error, lost)`` (default: log the error and end the process with exit 1)."""
    return lambda dog: StallCheck(dog, stall_s, on_lost, before_exit)


class StallCheck:
    """Runs after each heartbeat (``Watchdog.after_beat``); see the module docstring. Create it on the
    training thread: that is the thread whose place it reports."""

    def __init__(
        self,
        dog: Watchdog,
        stall_s: float,
        on_lost: Callable[[PeerLost, int], None] | None = None,
        before_exit: Callable[[PeerLost], None] | None = None,
    ) -> None:
        self.dog, self.stall_s = dog, stall_s
        self.look_s = min(LOOK_S, stall_s)
        self.on_lost = on_lost or exit_on_lost(dog)
        self.before_exit = before_exit
        self.done = False
        self._ending = threading.Lock()  # the heartbeat thread and the sentinel may both find a verdict: one ends
        self.training_thread = threading.get_ident()
        self._published = ""
        self._next_look = self._next_warning = 0.0
        self._seen: dict[int, str | None] = {}  # the heartbeats this rank read when it judged
        # the heartbeat thread cannot see its own store operation hang: this one can (a daemon, sleeping mostly)
        threading.Thread(target=self._sentinel, name="ddp_slurm-stall-sentinel", daemon=True).start()

    def __call__(self) -> None:
        dog = self.dog
        if dog.failing or self.done:
            return
        if dog._progress < 0:  # before this rank's first step (rendezvous, data, run directory): no verdict
            return  # a slow start is not a stall; the backend's timeout and the heartbeat still name a lost rank
        now = time.monotonic()
        idle = now - dog.moved
        if dog._seen is not None and dog._seen[0] and idle >= 2 * dog.interval_s:
            self._end(*dog._seen, idle)  # another rank found it while this one waits
            return
        if idle >= self.stall_s / 2:  # waiting: say where, for the rank that will look
            at = thread_at(self.training_thread)
            if at != self._published:
                dog._op("set", f"{AT}{dog.rank}", at)
                self._published = at
        if idle < self.look_s or now < self._next_look or dog.gap >= dog.grace_s:
            return  # not yet; or this rank was frozen itself: the others have judged it, it judges nobody
        self._next_look = now + self.look_s  # look at most once per look_s
        if dog._op("add", LEAD, 1) != 1:
            return  # another waiting rank is looking; its verdict arrives through the heartbeat
        stalled = idle >= self.stall_s  # a live rank behind counts only now: before, a long step looks alike
        found = find_stuck(dog, stuck=stalled, seen=self._seen)
        if not found:
            dog._op("set", LEAD, "0")
            if stalled and now >= self._next_warning:
                self._next_warning = now + self.stall_s
                log.warning("no progress for %.0f s, but every rank is alive and level%s", idle, self._places())
            return
        text = "; ".join(found)
        dog._op("set", "verdict", f"{len(found)}\t{text}")
        dog._op("add", "seen", 1)  # this rank knows it: the store's host lingers only for the others
        self._end(len(found), text, idle)

    def _sentinel(self) -> None:
        dog = self.dog
        while not (self.done or dog._stop.wait(dog.interval_s)):
            blocked, idle = dog.op_blocked_s(), time.monotonic() - dog.moved
            if blocked < STORE_LOST_S or idle < self.look_s or dog._progress < 0 or dog.failing or self.done:
                continue
            dog.store_gone = True  # from here on nothing may wait for the store: the lock is held by its operation
            owner = dog._store_owner()
            self._end(1, f"lost {owner}: the rendezvous store it hosted does not answer (waited {blocked:.0f} s)", idle)
            return

    def _places(self) -> str:
        """``: rank 2 (host h, pid p) is at X while ranks 0, 1 are at Y`` when the ranks stand apart."""
        dog, by_place = self.dog, defaultdict(list)
        for r in range(dog.world_size):
            key = f"{AT}{r}"
            by_place[dog._op("get", key).decode() if dog._op("check", [key]) else "an unknown place"].append(r)
        if len(by_place) < 2:
            return ": waiting on"
        groups = sorted(by_place.items(), key=lambda item: (-len(item[1]), item[1]))
        (common, waiting), odd = groups[0], groups[1:]
        if len(waiting) == len(odd[0][1]):  # no majority: just say where each stands
            return ": ranks stand apart: " + "; ".join(f"{', '.join(map(str, rs))} at {place}" for place, rs in groups)
        named = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(f'{r} ({_where(dog, r)})' for r in rs)} at {place}"
            for place, rs in odd
        )
        return (
            f": {named}, while ranks {', '.join(map(str, waiting))} are at {common}; if that does not come back, "
            "the backend's timeout ends the job"
        )

    def _end(self, count: int, text: str, idle: float) -> None:
        if not self._ending.acquire(blocking=False):
            return
        self.done = True
        dog = self.dog
        # The training thread may fail meanwhile (gloo: the leaving survivors close their sockets): its diagnosis
        # must be this verdict, not a second scan that finds those survivors silent too.
        dog._seen = (count, text)
        step = f"step {dog._progress}" if dog._progress >= 0 else "start-up"
        error = PeerLost(f"{text}; this rank waited {idle:.0f} s at {step} (found before the backend's timeout)")
        if self.before_exit is not None:  # first: the record is what makes the relaunch leave the host out
            try:
                self.before_exit(error)
            except Exception as exc:  # a record that fails must not keep this rank waiting forever
                log.warning("could not record the lost rank(s): %s", exc)
        view = {"verdict": text, "step": dog._progress, "waited_s": round(idle, 1)}
        view["at"] = thread_at(self.training_thread)
        view["heartbeats"] = dict(self._seen)  # "seq time step" as read; empty unless this rank judged
        flightrec.dump(dog.rank, view)
        self.on_lost(error, count)
