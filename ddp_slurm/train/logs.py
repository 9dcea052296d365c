"""Logging and progress: rank 0 speaks, other ranks only when something is wrong.

Every line carries the time; warnings and errors also carry rank and host, so a failure on rank 13
of 64 is found in one grep. Interactive runs (stderr is a terminal) get a tqdm bar per epoch on rank
0; batch runs (Slurm log files) get one plain line every ``log_every_s`` seconds, no carriage returns.
tqdm rather than rich: it is small, imports fast (startup time matters to every rank) and degrades to
nothing when told to. While a bar is on screen, log lines (a checkpoint written, from any thread) go
through ``tqdm.write``, which clears the bar, prints the line and redraws the bar below it: a line
written straight to the terminal would land in the middle of the bar.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import sys
import time
from collections.abc import Collection
from typing import Any

from ddp_slurm import text

# What gloo/NCCL say on a surviving rank when another rank has gone (crashed, killed, stopped answering).
_PEER_GONE = re.compile(
    r"closed by peer|reset by peer|broken pipe|timed out waiting|connection refused|"
    r"remote process exiting|communicator was aborted",
    re.IGNORECASE,
)


class _Formatter(logging.Formatter):
    def __init__(self, rank: int, host: str) -> None:
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")
        self.where = f"[rank {rank} {host}]"

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            head, _, rest = text.partition(" ")
            text = f"{head} {record.levelname} {self.where} {rest}"
        return text


def setup(rank: int, host: str | None = None) -> None:
    """Root logger to stderr: INFO on rank 0, WARNING elsewhere. Safe to call again."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(rank, host or socket.gethostname()))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def collective_failure(exc: BaseException) -> str | None:
    """The gist (one line) if ``exc`` is a collective that failed because another rank went away, else None.

    The rank that failed first logs its own traceback; a second traceback from every survivor would
    only bury it, so survivors log this one line instead.
    """
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if not _PEER_GONE.search(first):
        return None
    first = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", first)  # gloo's C++ source location
    return first.split(". This is typically caused by")[0]


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: short enough for a log line, exact enough to plan by."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Per-epoch progress on rank 0: a bar on a terminal, plain lines every ``every_s`` otherwise."""

    def __init__(self, enabled: bool, every_s: float, interactive: bool | None = None) -> None:
        self.enabled = enabled
        self.every_s = every_s
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar: Any = None
        self._routed = contextlib.ExitStack()  # the log handlers swapped for tqdm's while a bar is live
        self._last_line = time.monotonic()
        self._log = logging.getLogger("ddp_slurm.progress")

    def start_epoch(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        if self.enabled and self.interactive:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._routed.enter_context(logging_redirect_tqdm())  # the root logger's stderr handler
            self._bar = tqdm(
                total=steps,
                initial=done,
                desc=f"epoch {epoch + 1}/{epochs}",
                unit="step",
                leave=False,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def update(
        self,
        step: int,
        epoch: int,
        step_in_epoch: int,
        steps: int,
        loss: float | None,
        *,
        samples_per_s: float | None,
        eta_s: float | None,
    ) -> None:
        """Called every step with whatever figures are already on the host (no extra syncs)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step_in_epoch - self._bar.n)
            if loss is not None:
                self._bar.set_postfix({"loss": f"{loss:.4f}", "samples/s": f"{samples_per_s or 0:,.0f}"}, refresh=False)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_s:
            self._last_line = now
            figures = f" loss {loss:.4f}" if loss is not None else ""
            figures += f" {samples_per_s:,.0f} samples/s" if samples_per_s else ""
            figures += f" eta {_duration(eta_s)}" if eta_s is not None else ""
            self._log.info("epoch %d step %d/%d (global step %d)%s", epoch + 1, step_in_epoch, steps, step, figures)

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._routed.close()  # the plain handler again: lines between epochs need no bar to clear


def rank_map(hosts: list[str]) -> str:
    """``["a", "a", "b", "a"]`` (the host of each rank) -> ``"a: 0-1,3; b: 2"``, hosts in order of first rank."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    parts = []
    for host, ranks in by_host.items():
        runs: list[list[int]] = []
        for r in ranks:
            if runs and r == runs[-1][1] + 1:
                runs[-1][1] = r
            else:
                runs.append([r, r])
        parts.append(f"{host}: " + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs))
    return "; ".join(parts)


def resumed_from(step: int, launch: int, env: Any) -> str:
    """``from step 40 (launch 2)``, adding ``Slurm requeue 1`` inside a requeued Slurm job: the restart
    count is Slurm's, and a plain relaunch outside Slurm is not a restart of anything."""
    where = f"launch {launch}" if launch else ""
    if env.in_slurm_job and env.restart_count:
        where += (", " if where else "") + f"Slurm requeue {env.restart_count}"
    return f"from step {step}" + (f" ({where})" if where else "")


def metric(name: str, value: float, percent: Collection[str] | None = None) -> str:
    """``accuracy 97.50%`` for a fraction shown as a percentage (the task's ``percent_metrics``; by default
    the names containing ``accuracy``), ``loss 0.0812`` for the rest (``text.metric_value``)."""
    return f"{name} {text.metric_value(name, value, percent)}"
