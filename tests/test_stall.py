"""A lost or stuck rank named before the backend's timeout (distributed/stall.py), whatever the backend.

In-process: one Watchdog per pretend rank sharing one real store, as in test_faults.py. Real processes:
three ranks joined over gloo with a 60 s timeout, one of them frozen (SIGSTOP) or stuck (its training
thread sleeps while its heartbeat goes on): the others must name it within seconds, as they would have
to under NCCL, whose own watchdog would otherwise end them at the timeout without a word.
"""

from __future__ import annotations

import inspect
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, base_env

from ddp_slurm.distributed import stall
from ddp_slurm.distributed.watchdog import Watchdog

HOST = socket.gethostname()


def pack(
    world: int, stalling: list[int], stall_s: float = 0.6, before_exit: Any = None
) -> tuple[list[Watchdog], dict[int, tuple[str, int]]]:
    """Watchdogs for ``world`` ranks; those in ``stalling`` run the check, recording instead of exiting
    (``before_exit(rank, error)``: what runs before that)."""
    import torch.distributed as dist

    store = dist.HashStore()
    ended: dict[int, tuple[str, int]] = {}
    dogs = [
        Watchdog(dist.PrefixStore("t/", store), r, world, "127.0.0.1:4711", interval_s=0.1, grace_s=0.8)
        for r in range(world)
    ]
    for r in stalling:
        dogs[r].after_beat = stall.StallCheck(
            dogs[r],
            stall_s,
            lambda error, n, r=r: ended.setdefault(r, (str(error), n)),
            (lambda error, r=r: before_exit(r, error)) if before_exit else None,
        )
    for dog in dogs:
        dog.start()
    return dogs, ended


def wait_for(ended: dict[int, Any], ranks: list[int], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not all(r in ended for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)


def kill(dog: Watchdog) -> None:
    """A SIGKILL or a frozen node: the heartbeat stops and nothing marks the rank as ended."""
    dog._stop.set()
    dog._thread.join()


def test_deadline_is_well_inside_the_backend_timeout() -> None:
    assert stall.deadline_s(300) == 270 and stall.deadline_s(1800) == 1770 and stall.deadline_s(30) == 15
    for timeout in (2, 10, 59, 60, 61, 300, 3600):
        assert 0 < stall.deadline_s(timeout) <= timeout - min(timeout / 2, 30)
    # a lost rank's verdict (look, two reads grace_s apart, the others' pick-up within a beat) comes long before
    # NCCL's watchdog would abort at dist.timeout_s, and within seconds whatever that timeout is
    defaults = inspect.signature(Watchdog).parameters
    grace_s, beat_s = defaults["grace_s"].default, defaults["interval_s"].default
    for timeout in (20, 30, 60, 300, 1800):
        verdict = min(stall.LOOK_S, stall.deadline_s(timeout)) + grace_s + beat_s
        assert verdict <= 10 and verdict < timeout, (timeout, verdict)


def test_a_lost_rank_is_named_by_every_waiting_rank() -> None:
    dogs, ended = pack(3, stalling=[0, 1])
    for dog in dogs:
        dog.progress(7)
    kill(dogs[2])
    wait_for(ended, [0, 1])
    for dog in dogs[:2]:
        dog.stop()
    assert set(ended) == {0, 1}, ended
    for text, count in ended.values():
        assert count == 1
        assert re.match(
            rf"lost rank 2 \(host {HOST}, pid {os.getpid()}\): no heartbeat for \d+ s; this rank waited \d+ s at step 7",
            text,
        ), text


def test_the_lost_host_is_recorded_and_the_flight_recorder_dumped_before_the_rank_is_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: the stall check ends a rank with os._exit, so whatever must survive it happens first, in this
    order: the record in lost_nodes (the supervisor relaunches without the host), the flight-recorder file (what
    NCCL's watchdog would have dumped), then the end. The judging rank's file holds every rank's heartbeat."""
    from ddp_slurm.slurmjob import badnodes

    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "traces" / "7.0-rank"))
    order: list[tuple[str, int]] = []

    def record(rank: int, error: Exception) -> None:
        assert not (tmp_path / "traces" / f"7.0-rank{rank}").exists()  # the record comes before the dump
        badnodes.record(tmp_path, sorted(set(badnodes.lost(error).values())), "7", 0, str(error), rank)
        order.append(("record", rank))

    dogs, ended = pack(3, stalling=[0, 1], stall_s=60, before_exit=record)
    for dog in dogs[:2]:
        dog.after_beat.on_lost = lambda error, n, r=dog.rank: (order.append(("end", r)), ended.setdefault(r, n))
    for dog in dogs:
        dog.progress(7)
    kill(dogs[2])
    wait_for(ended, [0, 1])
    for dog in dogs[:2]:
        dog.stop()
    assert sorted(order) == [("end", 0), ("end", 1), ("record", 0), ("record", 1)]
    assert all(order.index(("record", r)) < order.index(("end", r)) for r in (0, 1)), order
    lines = [line.split("\t") for line in (tmp_path / "lost_nodes").read_text().splitlines()]
    assert sorted((f[0], f[4]) for f in lines) == [(HOST, "0"), (HOST, "1")], lines
    dumps = {r: pickle.loads((tmp_path / "traces" / f"7.0-rank{r}").read_bytes()) for r in (0, 1)}
    for rank, dump in dumps.items():
        assert {"version", "entries", "pg_config"} <= set(dump), dump.keys()  # torch's analyser reads these
        mine = dump["ddp_slurm"]
        assert mine["rank"] == rank and mine["step"] == 7 and mine["verdict"].startswith("lost rank 2 (host "), mine
        assert "test_stall.py" in mine["at"], mine  # where the (pretend) training thread stood
    judges = [r for r, dump in dumps.items() if dump["ddp_slurm"]["heartbeats"]]
    assert len(judges) == 1, dumps
    assert set(dumps[judges[0]]["ddp_slurm"]["heartbeats"]) == {0, 1, 2} - set(judges), dumps[judges[0]]


def test_a_lost_rank_is_named_within_seconds_whatever_the_stall_deadline() -> None:
    """The heartbeat's verdict does not depend on how long a step may take: a rank waiting LOOK_S looks for a
    dead heartbeat, while a live rank behind counts as stuck only at the (long) stall deadline."""
    dogs, ended = pack(4, stalling=[0, 1], stall_s=1000)
    for dog in dogs:
        dog.progress(5)
    dogs[3].progress(4)  # behind, but alive: not named before 1000 s
    kill(dogs[2])
    start = time.monotonic()
    wait_for(ended, [0, 1], timeout=stall.LOOK_S + 10)
    took = time.monotonic() - start
    for dog in (dogs[0], dogs[1], dogs[3]):
        dog.stop()
    assert set(ended) == {0, 1}, ended
    for text, count in ended.values():
        assert count == 1 and text.startswith(f"lost rank 2 (host {HOST}") and "stuck" not in text, text
    assert took < stall.LOOK_S + 10, took


def test_a_rank_frozen_and_continued_names_nobody_and_judges_nobody() -> None:
    """SIGSTOP, then Slurm's SIGCONT before it kills the step: the others named this rank and left, so every
    heartbeat but its own is silent now. It must not record them (or the store's host) as lost."""
    from ddp_slurm.slurmjob import badnodes

    dogs, ended = pack(2, stalling=[0], stall_s=0.3)
    dogs[0].progress(3)
    dogs[0]._beat_at -= 9  # its heartbeat stood still for 9 s
    error, count = dogs[0].explain(RuntimeError("Connection closed by peer [10.0.0.2]:4242"))
    time.sleep(1.5)
    for dog in dogs:
        dog.stop()
    assert count == 0 and str(error).startswith("this rank was frozen for 9 s, its heartbeat too"), error
    assert badnodes.lost(error) == {} and ended == {}


def test_a_published_verdict_is_the_diagnosis_of_a_rank_whose_collective_fails_before_its_heartbeat_reads_it() -> None:
    """The ranks that left on a stall verdict close their sockets: a rank's collective may fail before its own
    heartbeat has read the verdict. It must take that verdict, not scan and find the leavers silent too."""
    dogs, _ = pack(4, stalling=[])
    dogs[0]._op("set", "verdict", "1\tlost rank 2 (host node3, pid 9): no heartbeat for 8 s")
    for r in (1, 2, 3):
        kill(dogs[r])  # 2 vanished; 1 and 3 left on the verdict: none of them beats any more
    error, count = dogs[0].explain(RuntimeError("Connection closed by peer [10.0.0.2]:4242"))
    dogs[0].stop()
    assert count == 1 and str(error).startswith("lost rank 2 (host node3, pid 9): no heartbeat for 8 s;"), error


class Unanswered:
    """A store whose host froze or vanished without closing its socket: from ``freeze()`` on, every operation waits
    (until ``release()``, then fails as a store would)."""

    def __init__(self, store: Any) -> None:
        self.store, self.frozen, self.released = store, threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.store, name)

        def call(*args: Any) -> Any:
            if self.frozen.is_set():
                self.released.wait()
                raise RuntimeError("Connection reset by peer")
            return op(*args)

        return call


def test_a_store_host_that_stops_answering_is_named_and_recorded_before_the_rank_ends() -> None:
    """Rank 0 (the store's host under srun) frozen or its node gone: every store operation hangs, the heartbeat's
    too, so no heartbeat verdict can come. The sentinel sees the operation wait and names rank 0 by the host it
    read at start-up; the record comes before the end, and nothing waits for the store any more."""
    import torch.distributed as dist

    from ddp_slurm.slurmjob import badnodes

    store = Unanswered(dist.PrefixStore("t/", dist.HashStore()))
    dog = Watchdog(store, 1, 2, "node1:4711", interval_s=0.2, grace_s=0.8)
    order: list[str] = []
    ended: dict[int, tuple[str, int]] = {}
    dog.after_beat = stall.StallCheck(
        dog,
        60,
        # the default on_lost lingers for the others to read the verdict: not on a store that never answers
        lambda error, n: (order.append("end"), dog.linger(n), ended.setdefault(1, (str(error), n))),
        lambda error: order.append("record:" + ",".join(badnodes.lost(error).values())),
    )
    dog._rank0 = "node1 4711"  # read from the store at start-up, while rank 0 lived
    dog.start()
    dog.progress(3)
    store.frozen.set()
    try:
        wait_for(ended, [1], timeout=stall.STORE_LOST_S + 10)
    finally:
        store.released.set()
        dog.stop()
    [(text, count)] = ended.values()
    assert count == 1 and re.match(
        r"lost rank 0 \(host node1, pid 4711, store at node1:4711\): the rendezvous store it hosted does not answer "
        r"\(waited \d+ s\); this rank waited",
        text,
    ), text
    assert order == ["record:node1", "end"], order


def test_a_rank_whose_training_thread_is_stuck_is_named_with_its_step() -> None:
    """Its heartbeat lives (the process is fine), but it stays a step behind the others."""
    dogs, ended = pack(3, stalling=[0])
    dogs[0].progress(10)
    dogs[1].progress(10)
    dogs[2].progress(9)
    wait_for(ended, [0])
    for dog in dogs:
        dog.stop()
    [(text, count)] = ended.values()
    assert count == 1 and text.startswith(
        f"stuck rank 2 (host {HOST}, pid {os.getpid()}): at step 9 while others reached step 10"
    ), text


def test_the_rank_behind_names_itself() -> None:
    dogs, ended = pack(2, stalling=[1])
    dogs[0].progress(4)
    dogs[1].progress(3)
    wait_for(ended, [1])
    for dog in dogs:
        dog.stop()
    [(text, _)] = ended.values()
    assert text.startswith(
        f"stuck rank 1 (host {HOST}, pid {os.getpid()}, this rank): at step 3 while others reached step 4"
    ), text


def test_alive_and_level_ranks_are_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    """A long checkpoint or download: nobody behind, every heartbeat moving; no verdict, and a later
    look is possible again (the turn to look is handed back)."""
    dogs, ended = pack(3, stalling=[0, 1, 2], stall_s=0.4)
    for dog in dogs:
        dog.progress(5)
    time.sleep(3)
    for dog in dogs:
        dog.stop()
    assert ended == {}
    assert caplog.text.count("every rank is alive and level") >= 2  # the turn was handed back: looked again


def test_the_training_thread_failing_first_keeps_its_own_diagnosis() -> None:
    """gloo raised in the training thread, which is explaining: the heartbeat does not race it."""
    dogs, ended = pack(2, stalling=[0], stall_s=0.3)
    dogs[0].failing = True
    kill(dogs[1])
    time.sleep(2)
    dogs[0].stop()
    assert ended == {}


# ------------------------------------------------------------------------------- real processes
RANK = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from ddp_slurm.distributed import stall, watchdog
    from ddp_slurm.distributed.env import DistEnv

    mode, timeout = sys.argv[1], float(sys.argv[2])
    env = DistEnv.from_environ(os.environ)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{env.master_port}", rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(seconds=timeout))
    from pathlib import Path
    from ddp_slurm.slurmjob import badnodes

    def record(error):  # what training does (chain.after_peer_lost), before the check's os._exit
        badnodes.record(Path.cwd(), sorted(set(badnodes.lost(error).values())), "7", 0, str(error), env.rank)

    with watchdog.watch(env, after_beat=stall.checker(3.0, before_exit=record)) as dog:
        for step in range(1, 1000):
            dog.progress(step)
            if env.rank == 2 and step == 20:
                if mode == "frozen":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    time.sleep(120)
            t = torch.ones(4)
            dist.all_reduce(t)
            time.sleep(0.01)
""")


def start_ranks(tmp_path: Path, mode: str, timeout_s: float) -> list[subprocess.Popen]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(3):
        env = base_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="3",
            LOCAL_WORLD_SIZE="3",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(REPO),
            TORCH_FR_DUMP_TEMP_FILE=str(tmp_path / "traces" / "7.0-rank"),  # as the batch scripts set it
            TORCH_FR_BUFFER_SIZE="100",
        )
        cmd = [sys.executable, str(script), mode, str(timeout_s)]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], timeout_s: float) -> tuple[dict[int, tuple[int, str]], float]:
    """Wait for ranks 0 and 1; then end rank 2 (frozen or asleep). Returns each rank's (exit, output)."""
    start, outs = time.monotonic(), {}
    try:
        for rank in (0, 1):
            out, _ = procs[rank].communicate(timeout=timeout_s)
            outs[rank] = (procs[rank].returncode, out)
        took = time.monotonic() - start
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    outs[2] = (procs[2].wait(), procs[2].stdout.read())
    return outs, took


def test_real_ranks_name_a_frozen_rank_long_before_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP: the whole process stops, heartbeat included: ranks 0 and 1 end with the verdict (os._exit), having
    recorded rank 2's host in lost_nodes and dumped their flight recorder (gloo's collectives, the verdict)."""
    outs, took = finish(start_ranks(tmp_path, "frozen", 60), 50)
    for rank in (0, 1):
        code, out = outs[rank]
        assert code == 1, (rank, out)
        lines = [line for line in out.splitlines() if "lost rank 2 (host" in line]
        assert lines and "at step 20 (found before the backend's timeout)" in lines[0], (rank, out)
    assert took < 40, took  # gloo's own timeout is 60 s: the verdict came first
    lines = [line.split("\t") for line in (tmp_path / "lost_nodes").read_text().splitlines()]
    assert sorted((f[0], f[4]) for f in lines) == [(HOST, "0"), (HOST, "1")], lines
    for rank in (0, 1):
        dump = pickle.loads((tmp_path / "traces" / f"7.0-rank{rank}").read_bytes())
        assert dump["ddp_slurm"]["verdict"].startswith("lost rank 2 (host ") and dump["ddp_slurm"]["step"] == 20
        last = dump["entries"][-1]  # the all-reduce rank 2 never joined, still in flight
        assert last["profiling_name"] == "gloo:all_reduce" and not last["retired"], last


def test_real_ranks_say_where_a_rank_hangs_inside_a_step(tmp_path: Path) -> None:
    """Rank 2's training thread sleeps inside step 20, its heartbeat alive: same step as the others, who
    wait in that step's all-reduce. Not an error yet (a long checkpoint looks alike), but the log names
    rank 2 and the line it stands on, before gloo's timeout (20 s) ends the others."""
    outs, _ = finish(start_ranks(tmp_path, "stuck", 20), 50)
    text = "\n".join(out for _, out in outs.values())
    sleep_line = RANK.splitlines().index("                time.sleep(120)") + 1
    lines = [line for line in text.splitlines() if "every rank is alive and level: rank 2 (host" in line]
    assert lines, text
    assert (
        f"at rank.py:{sleep_line} in <module>, while ranks 0, 1 are at rank.py:{sleep_line + 2} in <module>" in lines[0]
    ), lines[0]
    assert outs[0][0] != 0 and outs[1][0] != 0  # then gloo's timeout ended them
