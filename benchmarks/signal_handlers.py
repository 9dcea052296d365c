"""How soon after a process is started its stop-signal handlers are in place (docs/faults.md, row 15).

Starts ``python -m ddp_slurm.train --help`` ten times and measures, from just before each start, when
the kernel first reports SIGUSR1 as caught (``SigCgt`` in /proc/PID/status): only the early stop flag
catches it, so that is the moment a stop signal stops being fatal. Next to it, for scale, the time a
bare ``python -c pass`` takes to run. Linux only. Run from the repository root:
``.venv/bin/python benchmarks/signal_handlers.py``.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time


def catches(pid: int, sig: int = signal.SIGUSR1) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


def main(rounds: int = 10) -> None:
    handlers, bare = [], []
    for _ in range(rounds):
        began = time.monotonic()
        child = subprocess.Popen(
            [sys.executable, "-m", "ddp_slurm.train", "--help"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        while not catches(child.pid):
            pass
        handlers.append(time.monotonic() - began)
        child.kill()
        child.wait()
        began = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.monotonic() - began)
    ms = lambda x: f"{x * 1000:.0f} ms"  # noqa: E731
    print(
        f"handlers in place: median {ms(statistics.median(handlers))} (min {ms(min(handlers))}, max "
        f"{ms(max(handlers))}); bare `python -c pass`: median {ms(statistics.median(bare))}"
    )


if __name__ == "__main__":
    main()
