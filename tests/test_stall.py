"""A lost or stuck rank named before the backend's timeout (distributed/stall.py), whatever the backend.

In-process: one Watchdog per pretend rank sharing one real store, as in test_faults.py. Real processes:
three ranks joined over gloo with a 60 s timeout, one of them frozen (SIGSTOP) or stuck (its training
thread sleeps while its heartbeat goes on): the others must name it within seconds, as they would have
to under NCCL, whose own watchdog would otherwise end them at the timeout without a word.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, base_env

from ddp_slurm.distributed import stall
from ddp_slurm.distributed.watchdog import Watchdog

HOST = socket.gethostname()


def pack(world: int, stalling: list[int], stall_s: float = 0.6) -> tuple[list[Watchdog], dict[int, tuple[str, int]]]:
    """Watchdogs for ``world`` ranks; those in ``stalling`` run the check, recording instead of exiting."""
    import torch.distributed as dist

    store = dist.HashStore()
    ended: dict[int, tuple[str, int]] = {}
    dogs = [
        Watchdog(dist.PrefixStore("t/", store), r, world, "127.0.0.1:4711", interval_s=0.1, grace_s=0.8)
        for r in range(world)
    ]
    for r in stalling:
        dogs[r].after_beat = stall.StallCheck(
            dogs[r], stall_s, lambda error, n, r=r: ended.setdefault(r, (str(error), n))
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
    with watchdog.watch(env, after_beat=stall.checker(3.0)) as dog:
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
        )
        cmd = [sys.executable, str(script), mode, str(timeout_s)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
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
    """SIGSTOP: the whole process stops, heartbeat included: ranks 0 and 1 end with the verdict."""
    outs, took = finish(start_ranks(tmp_path, "frozen", 60), 50)
    for rank in (0, 1):
        code, out = outs[rank]
        assert code == 1, (rank, out)
        lines = [line for line in out.splitlines() if "lost rank 2 (host" in line]
        assert lines and "at step 20 (found before the backend's timeout)" in lines[0], (rank, out)
    assert took < 40, took  # gloo's own timeout is 60 s: the verdict came first


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
