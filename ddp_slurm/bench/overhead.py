"""``bench overhead``: the real training loop against a bare PyTorch loop, same model, data, optimizer, batch.

  ddp_slurm  ``ddp_slurm.run`` in this process, the whole runtime as a user gets it: the entry point, a
             process group of one, the watchdog, the stop vote after every step, the loss window and
             its log line every ``train.log_every_steps`` (20), the progress display, and checkpoints
             at the default cadence (every 100 steps, asynchronous). Its rate is the one its own
             ``train`` rows in metrics.jsonl give, over every row after the first (the warm-up), so
             the saves in between are counted; the task is the MNIST one on the bundled sample,
             repeated so that one epoch holds the whole run (an evaluation every 39 steps would
             measure the evaluation), without evaluation data.
  bare       the loop a user writes by hand in 20 lines (``bare_loop`` below): the same model, the
             same uint8 images resident on the device and normalised per batch, the same per-epoch
             order, Adam (fused) with the same one-cycle schedule and batch, one host sync at the end.

The two alternate (ddp_slurm, bare, ddp_slurm, bare, ...), because the speed of a shared machine drifts
over seconds; ``ratio`` is the median over pairs of ddp_slurm / bare samples/s. Targets: >= 0.95 on
CPU, >= 0.97 for the cnn at batch 128 on a GPU. ``--cuda-graphs`` runs ddp_slurm with
``train.cuda_graphs=true`` (docs/gpu.md): the ratio is then the graphed loop's speed-up over the bare one.

Beside the rates, the ops one optimizer step dispatches (``opcount.py``: counted on CPU, deterministic): the
bare loop's, and the runtime's at world sizes 1 and 2 with what it adds by source (the stop vote, the loss
window, the guard's trace with ``--guard``, ...). ``--ops-only``: the count alone; ``--no-ops``: the rates alone.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ddp_slurm import argtypes
from ddp_slurm.bench import common, flags, opcount, workload
from ddp_slurm.bench.workload import LOG_EVERY, LongSample, bare_loop
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.tasks.mnist import data, models


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when there is a GPU")
    p.add_argument("--model", choices=models.MODELS, default="cnn")
    p.add_argument("--batch", type=flags.batch(), default=128, help="batch (default 128)")
    p.add_argument(
        "--steps",
        type=argtypes.integer(LOG_EVERY, flags.MAX_STEPS),
        default=None,
        help="measured steps per run, a multiple of 20 (default: 200 cpu, 2000 cuda)",
    )
    p.add_argument("--pairs", type=flags.count(), default=3, help="ddp_slurm/bare pairs (default 3)")
    p.add_argument("--cuda-graphs", action="store_true", help="ddp_slurm with train.cuda_graphs=true")
    p.add_argument(
        "--guard",
        action="store_true",
        help="also ddp_slurm with the guard on (guard.rollbacks=3: its trace and spike statistics), in each pair",
    )
    ops = p.add_mutually_exclusive_group()
    ops.add_argument("--no-ops", action="store_true", help="leave out the op count (opcount.py)")
    ops.add_argument("--ops-only", action="store_true", help="only the op count per step, no timing (deterministic)")


def ddp_slurm_loop(
    args: argparse.Namespace, steps: int, root: Path, index: int, device: torch.device, guard: bool = False
) -> float:
    """samples/s of one ``ddp_slurm.run`` (train rows after the first, saves included); ``guard``: on."""
    import ddp_slurm

    name = f"overhead-{index}{'-guard' if guard else ''}"
    overrides = [
        f"guard.rollbacks={3 if guard else 0}",
        f"model.name={args.model}",
        f"train.global_batch_size={args.batch}",
        f"train.max_steps={steps + LOG_EVERY}",
        f"train.log_every_steps={LOG_EVERY}",
        f"train.cuda_graphs={'true' if args.cuda_graphs else 'false'}",
        f"run.output_root={root}",
        f"run.name={name}",
    ]
    code = ddp_slurm.run(LongSample, overrides)
    if code != 0:
        raise common.BenchError(f"the ddp_slurm run exited {code} (its log is above): {' '.join(overrides)}")
    rows = [json.loads(line) for line in RunPaths(root / name).metrics.read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    first, last = rows[0], rows[-1]
    return (last["step"] - first["step"]) * args.batch / (last["time_s"] - first["time_s"])


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    if args.ops_only:  # counted on CPU whatever --device says: no device is touched
        return common.header(
            "overhead", "cpu", threads, model=args.model, batch=args.batch, guard=args.guard, ops_only=True
        ) | {"ops_per_step": opcount.measure(args.model, args.batch, args.guard)}
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the runtime would take a GPU it sees; CUDA is not initialised yet
    device = common.resolve_device(args.device)
    if device.type == "cpu" and torch.cuda.is_available():
        raise common.BenchError("--device cpu, but CUDA was initialised before: run with CUDA_VISIBLE_DEVICES=")
    if args.cuda_graphs and device.type != "cuda":
        raise common.BenchError("--cuda-graphs needs --device cuda (CUDA graphs are a GPU feature)")
    steps = args.steps if args.steps is not None else (2000 if device.type == "cuda" else 200)
    if steps % LOG_EVERY:
        raise common.BenchError(f"--steps {steps}: expected a multiple of {LOG_EVERY}")
    repeats = workload.repeats(steps, args.batch)
    # The sample repeated, uint8 images and int64 labels: in the bare loop, and in the run's task and loader.
    sample = data.TRAIN_SIZES["sample"] * (28 * 28 + 8)
    flags.check_memory(f"--steps {steps} --batch {args.batch}", 3 * repeats * sample)
    os.environ["DDP_SLURM_BENCH_REPEATS"] = str(repeats)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the runtime sets its threads from it, as under a launcher
    ours, guarded, bare, ratios, guard_ratios = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="ddp_slurm-overhead-") as tmp:
        for i in range(args.pairs):
            ours.append(ddp_slurm_loop(args, steps, Path(tmp), i, device))
            if args.guard:
                guarded.append(ddp_slurm_loop(args, steps, Path(tmp), i, device, guard=True))
            torch.set_num_threads(threads)
            bare.append(bare_loop(args.model, args.batch, steps, repeats, device))
            ratios.append(ours[-1] / bare[-1])
            if args.guard:
                guard_ratios.append(guarded[-1] / bare[-1])
    payload = common.header(
        "overhead",
        device,
        threads,
        model=args.model,
        batch=args.batch,
        steps=steps,
        pairs=args.pairs,
        cuda_graphs=args.cuda_graphs,
        guard=args.guard,
    )
    if args.guard:
        payload["guarded_samples_per_s"] = common.summary(guarded)
        payload["guard_ratio_per_pair"] = common.summary(guard_ratios)
        payload["guard_ratio"] = common.summary(guard_ratios)["median"]
    payload.update(
        {
            "ddp_slurm_samples_per_s": common.summary(ours),
            "bare_samples_per_s": common.summary(bare),
            "ratio_per_pair": common.summary(ratios),
            "ratio": common.summary(ratios)["median"],
        }
    )
    if not args.no_ops:
        payload["ops_per_step"] = opcount.measure(args.model, args.batch, args.guard)
    return payload


def render(p: dict[str, Any]) -> str:
    q = p["params"]
    ops = render_ops(p["ops_per_step"], q) if "ops_per_step" in p else ""
    if q.get("ops_only"):
        return ops
    ours = "ddp_slurm (train.cuda_graphs)" if q["cuda_graphs"] else "ddp_slurm"
    title = (
        f"bench overhead: {q['model']}, batch {q['batch']}, {p['device']}, {p['threads']} thread(s); "
        f"{q['pairs']} pair(s) of {q['steps']} steps, alternating"
    )
    rows = [
        [ours, *common.fmt_spread(p["ddp_slurm_samples_per_s"])],
        *([[f"{ours} + guard", *common.fmt_spread(p["guarded_samples_per_s"])]] if q.get("guard") else []),
        ["bare PyTorch loop", *common.fmt_spread(p["bare_samples_per_s"])],
    ]
    r = p["ratio_per_pair"]
    notes = [
        f"ratio {p['ratio']:.3f} (median over pairs of ddp_slurm / bare samples/s; {r['min']:.3f}-{r['max']:.3f})",
        *(
            [f"guard ratio {p['guard_ratio']:.3f} (the same with guard.rollbacks=3; the gap to ratio is its cost)"]
            if q.get("guard")
            else []
        ),
        "ddp_slurm: the whole runtime (vote, loss window, progress, watchdog, a checkpoint every 100 steps), "
        "rate from its own metrics rows after the first; bare: the same model, data, Adam and schedule by hand",
        f"load average {p['machine']['load_average_1m']}",
    ]
    timing = common.table(title, ["loop", "samples/s", "min-max", "spread"], rows, notes)
    return timing + ("\n\n" + ops if ops else "")


def render_ops(c: dict[str, Any], q: dict[str, Any]) -> str:
    """The op-count table: what one optimizer step dispatches, the bare loop's and the runtime's."""
    title = (
        f"ops per optimizer step: {q['model']}, batch {q['batch']}, counted on CPU over {c['steps']} steps "
        "(the log lines in them amortised)"
    )
    w1, bare = c["world_1"], c["bare"]
    extra = round(w1["launches"] - bare["launches"], 4)
    notes = [
        f"world 1 adds {extra:g} launches per step to the bare loop's {bare['launches']:g} "
        "(kernels + collectives + host reads; views and profiler marks launch nothing)",
        "extra by source: kernels, collectives and host reads per step outside the step and its batch ('step': the "
        "model, loss, backward, optimizer and schedule, as in the bare loop)",
        "not counted: CUDA events (the slow-rank clock's 2 per step where it times the forward, train/clock.py)",
    ]
    headers = ["loop", "kernels", "collectives", "host reads", "views", "extra by source"]
    return common.table(title, headers, opcount.render_rows(c), notes)
