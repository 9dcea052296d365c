"""``bench tta``: time for ``python -m ddp_slurm.train`` to reach a target test accuracy, over several seeds.

Each seed is a real training run (the given config, default: the built-in defaults, i.e. the cnn on the
bundled sample) on the device the trainer picks. The run evaluates on the whole test split at the end
of every epoch, as it always does; the time to target is the ``time_s`` of the first ``eval`` line in
its metrics.jsonl at or above the target: training wall time from the start of the run (data loading,
model, every step, every evaluation and checkpoint), not counting the interpreter's start-up (that is
``bench startup``). Once a run has reached the target it is stopped: the rest would not change the figure.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ddp_slurm import argtypes
from ddp_slurm.bench import common, flags
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train import metrics

MAX_SEED = 2**32 - 1  # run.seed's range


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        type=argtypes.number(0, 1, above=True),
        default=0.97,
        help="test accuracy to reach, 0-1 (default 0.97)",
    )
    p.add_argument(
        "--seeds",
        type=argtypes.integers(0, MAX_SEED, "run.seed's range", unique=True),
        default=[0, 1, 2],
        help="run.seed of each run, comma-separated (default 0,1,2)",
    )
    p.add_argument("--config", type=argtypes.input_file, help="job config (default: the built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.epochs=4")
    p.add_argument("--timeout", type=flags.seconds(), default=1800, help="seconds one run may take (default 1800)")


def first_at_target(path: Path, target: float) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The first eval row at or above ``target`` (None if not yet), and every eval row so far."""
    if not path.exists():
        return None, []
    evals = [row for row in metrics.read(path) if row.get("kind") == "eval"]
    hit = next((row for row in evals if row["accuracy"] >= target), None)
    return hit, evals


def one_run(seed: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    name = f"tta-seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "ddp_slurm.train",
        *(["--config", str(args.config.resolve())] if args.config else []),
        *args.overrides,
        f"run.seed={seed}",
        f"run.name={name}",
        f"run.output_root={tmp}",
    ]
    path = RunPaths(tmp / name).metrics
    log = tmp / f"{name}.log"
    env = common.child_env(**({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                code = proc.poll()
                hit, evals = first_at_target(path, args.target)
                if hit is not None or code is not None:
                    break
                if time.monotonic() - start > args.timeout:
                    raise common.BenchError(f"seed {seed}: no result after {args.timeout:g} s (see --timeout)")
                time.sleep(0.05)
        finally:
            if proc.poll() is None:  # our own child: the target is reached (or we gave up), the rest is not needed
                proc.kill()
                proc.wait()
    if hit is None and code not in (0, None):
        tail = " | ".join(log.read_text().strip().splitlines()[-4:])
        raise common.BenchError(f"seed {seed}: training exited {code}: {tail}")
    return {
        "seed": seed,
        "seconds": hit["time_s"] if hit else None,
        "epochs": hit["epoch"] + 1 if hit else None,
        "step": hit["step"] if hit else None,
        "accuracy": hit["accuracy"] if hit else None,
        "accuracies": [round(e["accuracy"], 4) for e in evals],
        "eval_times_s": [e["time_s"] for e in evals],
    }


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    flags.check_training_config(args.config, [*args.overrides, *(f"run.seed={seed}" for seed in args.seeds)])
    with tempfile.TemporaryDirectory(prefix="ddp_slurm-bench-") as tmp:
        runs = [one_run(seed, args, Path(tmp)) for seed in args.seeds]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # what the trainer picks (dist.backend auto)
    reached = [r["seconds"] for r in runs if r["seconds"] is not None]
    payload = common.header(
        "tta",
        device,
        threads,
        target=args.target,
        seeds=args.seeds,
        config=str(args.config) if args.config else None,
        overrides=list(args.overrides),
    )
    payload.update(
        {
            "runs": runs,
            "reached": len(reached),
            "seconds_to_target": statistics.mean(reached) if len(reached) == len(runs) else None,
            "seconds_to_target_stdev": statistics.stdev(reached) if len(reached) > 1 else 0.0,
            "seconds_to_target_min_max": [min(reached), max(reached)] if reached else None,
        }
    )
    return payload


def render(p: dict[str, Any]) -> str:
    q = p["params"]
    title = (
        f"bench tta: time to {100 * q['target']:g}% test accuracy, {len(q['seeds'])} seeds, "
        f"device {p['device']}; config {q['config'] or 'built-in defaults'} {' '.join(q['overrides'])}"
    ).rstrip()
    rows = [
        [
            str(r["seed"]),
            common.fmt(r["seconds"], 1),
            str(r["epochs"] or "not reached"),
            "n/a" if r["accuracy"] is None else f"{100 * r['accuracy']:.2f}%",
            " ".join(f"{100 * a:.1f}" for a in r["accuracies"]),
        ]
        for r in p["runs"]
    ]
    mean = p["seconds_to_target"]
    notes = [
        f"seconds to target: mean {common.fmt(mean, 1)}, stdev {p['seconds_to_target_stdev']:.1f}"
        + ("" if mean is not None else f" (reached by {p['reached']} of {len(p['runs'])} runs)"),
        "time = training wall time of the run up to that evaluation (steps, evaluations, checkpoints), "
        "without the interpreter's start-up",
        f"load average {p['machine']['load_average_1m']}",
    ]
    return common.table(title, ["seed", "seconds", "epochs", "accuracy", "test accuracy per epoch, %"], rows, notes)
