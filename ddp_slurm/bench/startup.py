"""``bench startup``: seconds from process start to the first optimizer step of ``python -m ddp_slurm.train``,
next to the seconds from process start to ``import torch`` being done, measured in the same run.

Both are timed from outside, by this process, from just before it starts the child until the child
prints a line, so both include the interpreter's own start and neither includes its exit:

* torch: ``python -c "import torch; print(...)"``, the line printed once the import is done;
* train: the real ``python -m ddp_slurm.train`` (run through ``runpy``, which is what ``-m`` does) with
  the given config, and one global optimizer-step hook (``torch.optim.optimizer.
  register_optimizer_step_post_hook``) that prints the line when the first step has finished and
  ends the process there. Nothing in the package knows it is being timed.

The two alternate (torch, train, torch, train, ...), several times; the figures are medians.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ddp_slurm import argtypes
from ddp_slurm.bench import common, flags

MARK = "ddp_slurm-bench-mark"
TORCH_CHILD = f"import torch; print({MARK!r}, flush=True)"
TRAIN_CHILD = f"""
import os, runpy, sys
import torch.optim.optimizer as _opt

def _first_step(optimizer, args, kwargs):
    sys.stdout.write({MARK!r} + "\\n")
    sys.stdout.flush()
    os._exit(0)

_opt.register_optimizer_step_post_hook(_first_step)
sys.argv = ["ddp_slurm.train", *sys.argv[1:]]
runpy.run_module("ddp_slurm.train", run_name="__main__", alter_sys=True)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=flags.count(), default=5, help="measurements of each (default 5)")
    p.add_argument(
        "--config",
        type=argtypes.input_file,
        help="job config for the training run (default: the built-in defaults)",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for the training run")
    p.add_argument("--timeout", type=flags.seconds(), default=600, help="seconds one child may take (default 600)")


def time_to_mark(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> float:
    """Seconds from starting ``cmd`` to its line ``MARK`` on stdout; an error with its output if none comes."""
    log = cwd / "child.log"
    with open(log, "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # blocks until the child writes a line or exits
                if line.strip() == MARK:
                    elapsed = time.perf_counter() - start
                    proc.wait(timeout=timeout)
                    return elapsed
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:  # our own child only
                proc.kill()
                proc.wait()
    tail = " | ".join(log.read_text().strip().splitlines()[-4:])
    raise common.BenchError(f"{' '.join(cmd[:3])} ... exited {proc.returncode} before its first step: {tail}")


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    flags.check_training_config(args.config, args.overrides)
    torch_s, train_s = [], []
    extra = ["--config", str(args.config.resolve())] if args.config else []
    env = common.child_env(**({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    with tempfile.TemporaryDirectory(prefix="ddp_slurm-bench-") as tmp:
        for i in range(args.repeats):
            cwd = Path(tmp) / f"r{i}"
            cwd.mkdir()
            torch_s.append(time_to_mark([sys.executable, "-c", TORCH_CHILD], cwd, args.timeout, env))
            train_s.append(
                time_to_mark(
                    [sys.executable, "-c", TRAIN_CHILD, *extra, *args.overrides, f"run.name=startup-{i}"],
                    cwd,
                    args.timeout,
                    env,
                )
            )
    a, b = common.summary(torch_s), common.summary(train_s)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # what the trainer picks (dist.backend auto)
    payload = common.header(
        "startup",
        device,
        threads,
        repeats=args.repeats,
        config=str(args.config) if args.config else None,
        overrides=list(args.overrides),
    )
    payload.update({"import_torch_s": a, "first_step_s": b, "startup_ratio": b["median"] / a["median"]})
    return payload


def render(p: dict[str, Any]) -> str:
    q = p["params"]
    title = f"bench startup: {q['repeats']} alternating runs of each, seconds from process start"
    rows = [
        ['python -c "import torch"  (until imported)', *common.fmt_spread(p["import_torch_s"], 2)],
        ["python -m ddp_slurm.train  (until its first optimizer step)", *common.fmt_spread(p["first_step_s"], 2)],
    ]
    notes = [
        f"startup ratio: {p['startup_ratio']:.2f}x the time of importing torch "
        f"({p['first_step_s']['median'] - p['import_torch_s']['median']:.2f} s more)",
        f"training config: {q['config'] or 'built-in defaults'} {' '.join(q['overrides'])}".rstrip(),
        f"load average {p['machine']['load_average_1m']}",
    ]
    return common.table(title, ["command", "median s", "min-max", "spread"], rows, notes)
