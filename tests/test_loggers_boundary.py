"""The training thread never waits on a logger (ddp_slurm/train/loggers/boundary.py): records queue up to
a bound, then are dropped and counted, the final record keeps its slot, and closing waits a bounded time.

The loggers here are small classes with the sink interface whose ``write`` blocks on a real
``threading.Event`` (as a client blocks on a socket); tests/test_loggers.py holds the end-to-end case
against a real server that never answers."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from ddp_slurm.train.loggers import boundary
from ddp_slurm.train.loggers.boundary import QUEUE_RECORDS, Boundary, close_all


class Gated:
    """A logger whose ``write`` waits for ``gate`` (open it to let the backlog through)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()  # the logger's thread is inside write
        self.kinds: list[tuple[str, int]] = []
        self.closed = False

    def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
        self.entered.set()
        self.gate.wait()
        self.kinds.append((kind, step))

    def close(self) -> None:
        self.closed = True


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_stuck_logger_never_holds_the_training_thread(caplog: pytest.LogCaptureFixture) -> None:
    """Its queue fills, later records are dropped and counted, the end record still gets in; close gives
    up after its timeout with one warning naming the logger and the counts."""
    sink = Gated()
    logger = Boundary("log.mlflow", lambda: sink)
    extra = 100
    logger.write("train", 0, 0, 0.0, loss=1.0)
    assert sink.entered.wait(10)  # the thread holds that one, blocked
    start = time.monotonic()
    for step in range(1, QUEUE_RECORDS + extra + 1):
        logger.write("train", step, 0, 0.0, loss=1.0)
    logger.write("end", 99999, 1, 1.0)
    assert time.monotonic() - start < 2.0  # thousands of records, none waited for
    with caplog.at_level(logging.WARNING, logger="ddp_slurm"):
        start = time.monotonic()
        close_all([logger], timeout_s=0.5)
        assert 0.4 < time.monotonic() - start < 2.0
    assert logger.dropped == extra
    (message,) = warnings(caplog)
    assert message == (
        f"log.mlflow: still busy 0.5 s after the last record ({QUEUE_RECORDS + 1} records not sent, {extra} "
        "dropped before); abandoned, training goes on without this logger"
    )
    sink.gate.set()  # the server answers at last: the thread finishes the backlog, end record included
    logger._done.wait(10)
    assert sink.kinds[-1] == ("end", 99999) and sink.closed
    assert len(sink.kinds) == QUEUE_RECORDS + 2


def test_a_slow_logger_gets_its_backlog_and_one_warning_for_what_was_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = Gated()
    logger = Boundary("log.csv", lambda: sink)
    logger.write("train", 0, 0, 0.0)
    assert sink.entered.wait(10)
    for step in range(1, QUEUE_RECORDS + 11):
        logger.write("train", step, 0, 0.0)
    logger.write("stop", 7, 0, 0.0)
    threading.Timer(0.3, sink.gate.set).start()  # catches up during the close
    with caplog.at_level(logging.WARNING, logger="ddp_slurm"):
        close_all([logger], timeout_s=20)
    assert sink.closed and sink.kinds[-1] == ("stop", 7) and len(sink.kinds) == QUEUE_RECORDS + 2
    assert logger.dropped == 10
    assert warnings(caplog) == [
        f"log.csv: 10 records dropped: the logger fell {QUEUE_RECORDS} records behind (metrics.jsonl has them all)"
    ]


def test_loggers_close_together_under_one_deadline() -> None:
    """Three stuck loggers cost one timeout, not three."""
    stuck = [Gated() for _ in range(3)]
    bounded = [Boundary(f"log.{i}", lambda s=s: s) for i, s in enumerate(stuck)]
    for logger in bounded:
        logger.write("train", 1, 0, 0.0)
    start = time.monotonic()
    close_all(bounded, timeout_s=0.5)
    assert time.monotonic() - start < 1.2
    for s in stuck:
        s.gate.set()


def test_after_a_stop_record_the_wait_is_the_short_one(caplog: pytest.LogCaptureFixture) -> None:
    """A stopped job has the scheduler's SIGKILL coming: the loggers get STOP_CLOSE_TIMEOUT_S, not
    CLOSE_TIMEOUT_S."""
    assert boundary.STOP_CLOSE_TIMEOUT_S < boundary.CLOSE_TIMEOUT_S
    stuck = Gated()
    logger = Boundary("log.mlflow", lambda: stuck)
    logger.write("train", 1, 0, 0.0)
    logger.write("stop", 1, 0, 0.0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ddp_slurm"):
        close_all([logger, Boundary("log.csv", Gated)])
    assert boundary.STOP_CLOSE_TIMEOUT_S <= time.monotonic() - start < boundary.STOP_CLOSE_TIMEOUT_S + 1
    (message,) = warnings(caplog)
    assert message.startswith(f"log.mlflow: still busy {boundary.STOP_CLOSE_TIMEOUT_S:g} s after the last record")
    stuck.gate.set()


def test_an_opener_that_hangs_does_not_hold_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    """Opening (a server's first request) runs in the logger's thread too."""
    gate = threading.Event()

    def opener() -> Gated:
        gate.wait()
        raise ConnectionError("server never answered")

    start = time.monotonic()
    logger = Boundary("log.wandb", opener)
    logger.write("start", 0, 0, 0.0)
    assert time.monotonic() - start < 0.5
    gate.set()
    with caplog.at_level(logging.WARNING, logger="ddp_slurm"):
        close_all([logger], timeout_s=10)
    assert warnings(caplog) == [
        "log.wandb: could not start (ConnectionError: server never answered); training goes on without this logger"
    ]


def test_a_logger_that_raises_is_one_warning_then_off(caplog: pytest.LogCaptureFixture) -> None:
    class Failing(Gated):
        def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
            super().write(kind, step, epoch, time_s)
            raise ValueError("bad value")

    sink = Failing()
    sink.gate.set()
    logger = Boundary("log.csv", lambda: sink)
    for step in range(5):
        logger.write("train", step, 0, 0.0)
    with caplog.at_level(logging.WARNING, logger="ddp_slurm"):
        close_all([logger], timeout_s=10)
    assert sink.kinds == [("train", 0)] and not sink.closed  # off after the first failure
    assert warnings(caplog) == [
        "log.csv: logging a train record failed (ValueError: bad value); training goes on without this logger"
    ]


def test_a_logger_that_exits_its_thread_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A library that raises SystemExit (not an Exception) ends the logger's thread: one warning; the
    records written after it are not reported again as dropped."""

    class Exiting(Gated):
        def write(self, kind: str, step: int, epoch: int, time_s: float, **fields: Any) -> None:
            raise SystemExit(3)

    logger = Boundary("log.wandb", Exiting)
    with caplog.at_level(logging.WARNING, logger="ddp_slurm"):
        logger.write("train", 0, 0, 0.0)
        assert logger._done.wait(10)
        for step in range(1, QUEUE_RECORDS + 50):
            logger.write("train", step, 0, 0.0)
        close_all([logger], timeout_s=10)
    assert warnings(caplog) == ["log.wandb: stopped (SystemExit); training goes on without this logger"]


def test_the_bounds_are_the_ones_the_docs_give() -> None:
    from conftest import REPO

    doc = " ".join((REPO / "docs" / "loggers.md").read_text().split())
    assert f"{boundary.QUEUE_RECORDS} records" in doc
    assert f"{boundary.CLOSE_TIMEOUT_S:g} s" in doc and f"{boundary.STOP_CLOSE_TIMEOUT_S:g} s" in doc
