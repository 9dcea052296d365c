"""`make test`: the Slurm cluster tests and the rest of the suite as two pytest runs side by side.

The cluster tests spend most of their time waiting on Slurm (a requeue's hold, a node's timeout, a job's
queue), the rest spend it computing; run one after the other they took about 43 minutes of CI's 90, side
by side the waits of one are the other's compute. The cluster run then takes a few of the rest's files
(``AFTER_CLUSTER``) once its Slurm tests are done, so that both end about together; the Slurm tests, which
time faults, still run beside one other run only. Each run writes its own log; both are printed whole when
both have ended (cluster first), then one closing line that sums them. The exit status is the first
non-zero of the two (pytest's 5, "no tests collected", counts as a failure: a suite that ran nothing did
not pass). A green suite removes its temporary root (logs included: they were printed); a red one keeps
it and says where.

    python tests/run_suite.py [PYTEST_ARGS...]   # the arguments go to both runs
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLUSTER = "tests/cluster"
# Where the time goes, in CI's own log: the slowest tests of each run.
DURATIONS = "--durations=15"
# The most the suite holds at once is about two gigabytes per lane (one test's checkpoints); ask for headroom.
MIN_FREE_GIB = 4
# Rest files the cluster run takes after its own: alone, the rest took 44 minutes in CI and the cluster tests
# 19; these three took 12 of the 44 (`--durations=0` summed per file). Keep the two runs about even.
AFTER_CLUSTER = ("tests/test_resume.py", "tests/test_faults.py", "tests/test_config.py")
COUNTED = ("passed", "failed", "skipped", "errors", "error", "xfailed", "xpassed")


def counts(log: str) -> dict[str, int]:
    """The counts on pytest's closing line (``== 3 failed, 1500 passed, 20 skipped in 900.1s ==``)."""
    lines = [
        line
        for line in log.splitlines()
        if re.search(r" in [\d.]+s\b", line) and re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", line)
    ]
    found: dict[str, int] = {}
    for number, word in re.findall(r"(\d+) (\w+)", lines[-1] if lines else ""):
        if word in COUNTED:
            key = "failed" if word in ("errors", "error") else word
            found[key] = found.get(key, 0) + int(number)
    return found


def main(argv: list[str]) -> int:
    runs = {
        "cluster": [CLUSTER, *AFTER_CLUSTER, *argv],  # pytest runs the paths in the order given
        "rest": [f"--ignore={path}" for path in (CLUSTER, *AFTER_CLUSTER)] + argv,
    }
    logs = Path(tempfile.mkdtemp(prefix="ddp-slurm-suite-"))
    # a full disk fails tests far from the cause (a checkpoint write in one, a fixture in the next): say it first
    free_gib = shutil.disk_usage(logs).free / 2**30
    print(f"temporary root {logs}: {free_gib:.1f} GiB free", flush=True)
    if free_gib < MIN_FREE_GIB:
        print(f"WARNING: under {MIN_FREE_GIB} GiB free where the suite writes; tests may fail with ENOSPC", flush=True)
    began = time.monotonic()
    started = {}
    for name, args in runs.items():
        out = (logs / f"{name}.log").open("w")
        # each its own temporary root: two sessions pruning one numbered root could take each other's folders
        cmd = [sys.executable, "-m", "pytest", DURATIONS, f"--basetemp={logs / (name + '-tmp')}", *args]
        started[name] = (subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT), out)
        print(f"started: {' '.join(cmd[1:])} (log: {logs / f'{name}.log'})", flush=True)
    codes = {}
    for name, (proc, out) in started.items():
        codes[name] = proc.wait()
        out.close()
    total: dict[str, int] = {}
    for name in runs:
        text = (logs / f"{name}.log").read_text(errors="replace")
        print(f"\n######## pytest {name} (exit {codes[name]})\n{text}", flush=True)
        for key, number in counts(text).items():
            total[key] = total.get(key, 0) + number
    minutes = (time.monotonic() - began) / 60
    print(f"\nboth runs ended in {minutes:.1f} min; exit codes: {codes}")
    failed = total.get("failed", 0) + sum(1 for code in codes.values() if code not in (0, 1))
    print(f"suite: {total.get('passed', 0)} passed, {failed} failed, {total.get('skipped', 0)} skipped", flush=True)
    status = next((code for code in codes.values() if code != 0), 0)
    if status == 0:
        shutil.rmtree(logs, ignore_errors=True)
    else:
        print(f"kept for inspection: {logs}", flush=True)
    return status


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
