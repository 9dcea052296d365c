"""Logs and progress of real training runs: the start summary, a crash on one rank, the progress bar on
a real pseudo-terminal and the plain lines of batch logs."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import helpers
from conftest import base_env

from ddp_slurm.train import logs

TINY = ["model.name=mlp", "train.epochs=1", "train.max_steps=20", "train.log_every_steps=5"]
HOST = socket.gethostname()

CRASH = helpers.INJECTING_HARNESS


def our_tracebacks(text: str) -> list[str]:
    """Traceback blocks that go through the training code (torchrun's agent prints its own, about itself)."""
    blocks = text.split("Traceback (most recent call last):")[1:]
    return [b for b in blocks if "ddp_slurm/train/" in b]


def test_crash_on_one_rank_prints_its_traceback_once(launcher, tmp_path):
    harness = tmp_path / "crash_harness.py"
    harness.write_text(CRASH)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(harness),
        *TINY,
        "train.max_steps=50",
    ]
    res = launcher.run(cmd, env=base_env(CRASH_RANK="1", CRASH_AT="3"))
    out = res.stdout + res.stderr
    assert res.returncode != 0
    [block] = our_tracebacks(out)  # once: not again from rank 0, whose collective lost its peer
    assert "ValueError: injected failure on rank 1" in block
    before = out.split("Traceback (most recent call last):")[0].splitlines()
    assert re.match(rf"\d\d:\d\d:\d\d ERROR \[rank 1 {re.escape(HOST)}\] training failed$", before[-1]), before[-3:]
    assert out.count("ValueError: injected failure on rank 1") == 1
    # rank 0 says in one line (if torchrun let it live that long) why it stopped too
    for line in out.splitlines():
        if f"ERROR [rank 0 {HOST}]" in line:
            assert "another rank stopped answering" in line, line
    # info lines come from rank 0 only: one start summary for the two ranks
    summaries = [l for l in out.splitlines() if re.search(r"starting run \S+: world size 2 on 1 node", l)]
    assert len(summaries) == 1 and summaries[0].endswith(
        "via torchrun, backend gloo, device cpu, ddp fp32, fresh start"
    ), summaries


def test_crash_then_resume_summary(launcher, tmp_path):
    harness = tmp_path / "crash_harness.py"
    harness.write_text(CRASH)
    args = [*TINY, "train.max_steps=30", "checkpoint.every_steps=5", "run.name=resumed"]
    first = launcher.run([sys.executable, str(harness), *args], env=base_env(CRASH_AT="8"))
    assert first.returncode == 1, first.stderr
    [block] = our_tracebacks(first.stderr)
    assert "ValueError: injected failure on rank 0" in block
    assert f"ERROR [rank 0 {HOST}] training failed\nTraceback" in first.stderr
    assert re.search(
        r"starting run runs/resumed: world size 1 on 1 node\(s\) via single, backend gloo, "
        r"device cpu, ddp fp32, fresh start",
        first.stderr,
    ), first.stderr
    second = launcher.run([sys.executable, str(harness), *args])  # the same task, no fault this time
    assert second.returncode == 0, second.stderr
    # step 7 completed but only step 5 was checkpointed: the relaunch says where it resumes from
    assert re.search(
        r"resuming run runs/resumed: world size 1 on 1 node\(s\) via single, backend gloo, "
        r"device cpu, ddp fp32, from step 5 \(launch 2\)$",
        second.stderr,
        re.M,
    ), second.stderr
    assert "restart" not in second.stderr  # outside Slurm nothing was restarted: "restart 0" said nothing


def test_resumed_from_names_the_launch_and_a_slurm_requeue():
    from types import SimpleNamespace

    plain = SimpleNamespace(in_slurm_job=False, restart_count=0)
    assert logs.resumed_from(40, 2, plain) == "from step 40 (launch 2)"
    requeued = SimpleNamespace(in_slurm_job=True, restart_count=1)
    assert logs.resumed_from(40, 3, requeued) == "from step 40 (launch 3, Slurm requeue 1)"
    first_job = SimpleNamespace(in_slurm_job=True, restart_count=0)
    assert logs.resumed_from(40, 2, first_job) == "from step 40 (launch 2)"


def _read_all(fd: int, proc: subprocess.Popen, limit_s: float = 600) -> bytes:
    out, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out


def _on_terminal(cmd: list[str], cwd: Path, columns: int) -> tuple[int, str]:
    """Run ``cmd`` with stderr on a real pseudo-terminal ``columns`` wide: (exit code, what it drew)."""
    main_fd, term_fd = pty.openpty()
    fcntl.ioctl(term_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=base_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=term_fd
    )
    os.close(term_fd)
    try:
        text = _read_all(main_fd, proc).decode(errors="replace")
        proc.wait(timeout=60)
    finally:
        os.close(main_fd)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, text


def test_progress_bar_on_a_terminal(tmp_path):
    """stderr is a real pseudo-terminal: rank 0 draws a tqdm bar with loss, samples/s and ETA."""
    # a cnn with small batches: slow enough per step for the bar to redraw with figures in it
    cmd = [
        sys.executable,
        "-m",
        "ddp_slurm.train",
        "model.name=cnn",
        "train.global_batch_size=32",
        "train.epochs=1",
        "train.max_steps=60",
        "train.log_every_steps=5",
    ]
    code, text = _on_terminal(cmd, tmp_path, columns=160)
    assert code == 0, text
    assert "\r" in text  # redrawn in place
    frames = [f for f in text.split("\r") if f.startswith("epoch 1/1:")]
    assert frames, text
    # the bar's total is this epoch's steps, capped by train.max_steps
    assert any(re.search(r"\| \d+/60 \[", f) for f in frames), frames[-3:]
    with_figures = [f for f in frames if "loss=" in f and "samples/s=" in f]
    assert with_figures, frames[-3:]
    assert re.search(r"\d+:\d\d<\d+:\d\d", with_figures[-1]), with_figures[-1]  # elapsed<ETA
    assert re.search(r"epoch 1/1: train loss \d", text)


def test_log_lines_go_through_the_live_bar(tmp_path):
    """A checkpoint every 2 steps while the bar is on a real pseudo-terminal: each checkpoint line is
    written through tqdm (the bar cleared first, ``\\r`` then blanks then ``\\r``), so it starts on a
    clean line and never lands inside the bar's text."""
    cmd = [
        sys.executable,
        "-m",
        "ddp_slurm.train",
        "model.name=mlp",
        "train.global_batch_size=32",
        "train.epochs=1",
        "train.max_steps=12",
        "train.log_every_steps=4",
        "checkpoint.every_steps=2",
        "checkpoint.async=false",  # the line is logged on the training thread, between two bar updates
    ]
    code, text = _on_terminal(cmd, tmp_path, columns=120)
    assert code == 0, text
    lines = [line for line in text.split("\n") if "checkpoint runs/" in line]
    assert len(lines) == 6, text  # steps 2, 4, ..., 12
    for line in lines:
        shown = line.rstrip("\r").split("\r")[-1]  # what the terminal shows: the text after the last \r
        assert re.match(r"\d\d:\d\d:\d\d checkpoint runs/", shown), repr(line)
        assert "epoch 1/1" not in line.split("checkpoint")[0].rsplit("\r", 1)[-1], repr(line)
    cleared = [line for line in lines if re.search(r"\r +\r\d\d:\d\d:\d\d checkpoint", line)]
    assert len(cleared) >= 5, [repr(line) for line in lines]  # tqdm.write: the bar was live and was cleared
    assert re.search(r"\repoch 1/1:", text)  # and redrawn after the lines


def test_batch_log_has_plain_lines_only(launcher):
    """stderr is a file (a Slurm log): no bar, no carriage return; timed progress lines and an epoch line."""
    res = launcher.run(
        launcher.cmd_train(
            "model.name=mlp",
            "train.global_batch_size=32",
            "train.epochs=2",
            "train.max_steps=200",
            "train.log_every_steps=5",
            "train.log_every_s=0.01",
        )
    )
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stderr
    progress = re.findall(
        r"^\d\d:\d\d:\d\d epoch (\d) step (\d+)/(\d+) \(global step (\d+)\) loss [\d.]+ "
        r"[\d,]+ samples/s eta \d+(?:s|m\d\ds|h\d\dm)$",
        res.stderr,
        re.M,
    )
    assert len(progress) >= 2, res.stderr
    assert {p[2] for p in progress if p[0] == "2"} <= {"44"}  # epoch 2 ends early at step 200 = 156 + 44
    assert re.search(r"epoch 1/2: train loss [\d.]+, test accuracy", res.stderr)
    assert re.search(r"epoch 2/2: train loss [\d.]+, test accuracy", res.stderr)


def test_collective_failure_is_recognised():
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
        "[127.0.0.1]:18574. This is typically caused by a remote worker crashing.\nmore"
    )
    assert logs.collective_failure(gloo) == "Connection closed by peer [127.0.0.1]:18574"
    assert logs.collective_failure(ValueError("a bug of our own")) is None


def test_duration_format():
    assert [logs._duration(s) for s in (0, 42.4, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]


def test_one_rank_on_one_host_is_said_in_the_singular(caplog) -> None:
    """The placement line of a 1-rank run said "(1 ranks, 1 hosts)"; a 2-rank run "(2 ranks, 1 hosts)"."""
    from ddp_slurm import text
    from ddp_slurm.distributed.env import DistEnv
    from ddp_slurm.train import window

    env = DistEnv.from_environ({})
    with caplog.at_level("INFO", logger=window.log.name):
        window.log_placement(env, None)
    assert f"ranks by host (1 rank, 1 host): {socket.gethostname()}: 0" in caplog.text, caplog.text
    assert [text.counted(n, "rank") for n in (0, 1, 2)] == ["0 ranks", "1 rank", "2 ranks"]


def test_a_metric_is_shown_as_a_percentage_only_when_it_is_a_fraction() -> None:
    """The default: names containing ``accuracy`` are fractions (x100, %); a task declaring
    ``percent_metrics`` decides (a task returning percentages declares ``()`` and saw ``9750.00%`` before)."""
    assert logs.metric("accuracy", 0.975) == "accuracy 97.50%"
    assert logs.metric("mse", 0.0123) == "mse 0.0123"
    assert logs.metric("accuracy", 97.5, ()) == "accuracy 97.5"
    assert logs.metric("top5", 0.5, ("top5",)) == "top5 50.00%"
