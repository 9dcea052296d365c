"""Per-rank memory of DDP against FSDP2 (``dist.strategy``), side by side on the same model.

``python -m ddp_slurm.bench memory --strategy ddp,fsdp --world N`` starts N local ranks per strategy
(``ddp_slurm.bench.strategy_worker``): a stack of ``--depth`` linear blocks of ``--width`` (plus a head)
trained with Adam a few steps, built as ``ddp_slurm.train`` builds it. Per rank it reports the bytes of
parameters, gradients and optimizer state (the local shards under FSDP: what each rank holds), the
peak memory (CUDA: ``max_memory_allocated``; CPU: peak RSS above the RSS before the model was built,
which also counts FSDP's gathered units and the communication buffers), and the time per step.

``fsdp_over_ddp`` = FSDP's model-state bytes on the rank holding most / DDP's: about ``1/N`` (the target
is at most ``1/N + 0.1``); what it does not shard (buffers, activations) and the units it gathers
show in the peak.

Activation memory (``train.activation_checkpoint``), measured in this process (``bench/activations.py``):
the bytes one step keeps for backward with and without checkpointing each unit (CPU: saved tensors;
CUDA: ``max_memory_allocated``) and their ratio, on the same stack (``--batch`` samples; a stack of
Linear+ReLU blocks keeps only each block's input either way, so its ratio is about 1) or on a task's
model, units and first ``--batch`` training samples (``--task examples/addition/task.py:Addition``).
``--accumulate N`` runs each step as N micro-batches (``train.accumulate``) of the ``BATCH`` samples a
rank takes per step; the gradient bytes are then the most a rank held at any micro-batch boundary, FSDP's
unsharded gradients included (docs/scaling.md: under fsdp they stay sharded, about 1/N of DDP's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from ddp_slurm import argtypes
from ddp_slurm.bench import activations, common, flags

STRATEGIES = ("ddp", "fsdp")
MAX_WIDTH, MAX_DEPTH = 1 << 16, 10_000  # their product is bounded by the host's memory (measure)
BYTES_PER_PARAM = 16  # fp32 parameter, gradient and Adam's two moments: what a DDP rank holds
BATCH = 32  # samples per rank per step (strategy_worker's --batch), split into --accumulate micro-batches


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default="ddp,fsdp", help="strategies to compare, comma-separated (ddp,fsdp)")
    p.add_argument("--world", type=flags.per_cpu(), default=2, help="local ranks (processes)")
    p.add_argument("--width", type=argtypes.integer(1, MAX_WIDTH), default=1024, help="width of each linear block")
    p.add_argument("--depth", type=argtypes.integer(1, MAX_DEPTH), default=8, help="linear blocks (each one FSDP unit)")
    p.add_argument("--steps", type=flags.steps(), default=5, help="steps timed after 2 warm-up steps")
    p.add_argument(
        "--accumulate",
        type=argtypes.integer(1, BATCH, f"the {BATCH} samples per rank per step"),
        default=1,
        help=f"micro-batches per step (train.accumulate); must divide the {BATCH} samples per rank",
    )
    p.add_argument("--timeout", type=flags.seconds(), default=600.0, help="seconds before a rank is given up")
    p.add_argument("--batch", type=argtypes.integer(1, 1 << 16), default=32, help="samples of the activation measure")
    p.add_argument(
        "--task", default=None, metavar="REF", help="measure activations on this task's model (task=REF) instead"
    )


def strategies(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    if not chosen or any(s not in STRATEGIES for s in chosen):
        raise common.BenchError(f"--strategy {text!r}: expected a comma-separated choice of {', '.join(STRATEGIES)}")
    return chosen


def run_ranks(
    mode: str, strategy: str, world: int, threads: int, folder: Path, timeout: float, extra: list[str]
) -> list[dict[str, Any]]:
    """Every rank's JSON result of ``strategy_worker --mode mode``."""

    def command(out: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ddp_slurm.bench.strategy_worker",
            "--mode",
            mode,
            "--strategy",
            strategy,
            "--out",
            str(out),
            *extra,
        ]

    outs = common.run_local_ranks(f"{mode} {strategy}", world, threads, folder, f"{mode}-{strategy}", timeout, command)
    return [json.loads(out.read_text()) for out in outs]


def measure(args: argparse.Namespace, threads: int | None) -> dict[str, Any]:
    chosen = strategies(args.strategy)
    params = args.depth * (args.width**2 + args.width) + args.width + 1
    flags.check_memory(
        f"--width {args.width} --depth {args.depth} --world {args.world}", args.world * BYTES_PER_PARAM * params
    )
    if BATCH % args.accumulate:
        raise common.BenchError(f"--accumulate {args.accumulate}: must divide the {BATCH} samples per rank per step")
    device = common.resolve_device("auto")
    if args.task:  # a task that cannot be used is one line before any rank starts
        from ddp_slurm.config import ConfigError

        try:
            build = activations.task_model(args.task, args.batch, device)
        except ConfigError as exc:
            raise common.BenchError(f"--task {args.task}: {exc}") from None
    else:
        build = activations.linear_stack(args.width, args.depth, args.batch, device)
    per_rank_threads = 1
    extra = ["--width", str(args.width), "--depth", str(args.depth), "--steps", str(args.steps)]
    extra += ["--batch", str(BATCH), "--accumulate", str(args.accumulate)]
    with tempfile.TemporaryDirectory(prefix=".bench-memory-", dir=Path.cwd()) as tmp:
        by = {s: run_ranks("memory", s, args.world, per_rank_threads, Path(tmp), args.timeout, extra) for s in chosen}
    payload = common.header(
        "memory", "cuda" if by[chosen[0]][0]["peak_kind"].startswith("cuda") else "cpu", per_rank_threads,
        strategies=chosen, world=args.world, width=args.width, depth=args.depth, steps=args.steps,
        accumulate=args.accumulate,
    )  # fmt: skip
    summary = {}
    for s, ranks in by.items():
        summary[s] = {
            "ranks": ranks,
            "num_params": ranks[0]["num_params"],
            "model_state_bytes": max(r["model_state_bytes"] for r in ranks),
            "grad_bytes": max(r["grad_bytes"] for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks),
            "step_s": max(r["step_s"] for r in ranks),
        }
    payload["strategies"] = summary
    payload["activations"] = dict(activations.compare(build, device), model=args.task or "stack", batch=args.batch)
    if "ddp" in summary and "fsdp" in summary:
        ddp, fsdp = summary["ddp"], summary["fsdp"]
        payload["fsdp_over_ddp"] = fsdp["model_state_bytes"] / ddp["model_state_bytes"]
        payload["fsdp_over_ddp_grads"] = fsdp["grad_bytes"] / ddp["grad_bytes"]
        payload["fsdp_over_ddp_peak"] = fsdp["peak_bytes"] / max(ddp["peak_bytes"], 1)
        payload["fsdp_over_ddp_step_time"] = fsdp["step_s"] / ddp["step_s"]
        payload["target"] = 1 / args.world + 0.1
    return payload


def render(p: dict[str, Any]) -> str:
    mib = 2**20
    rows = []
    for s, r in p["strategies"].items():
        worst = max(r["ranks"], key=lambda x: x["model_state_bytes"])
        rows.append(
            [
                s,
                common.fmt(worst["param_bytes"] / mib, 1),
                common.fmt(worst["grad_bytes"] / mib, 1),
                common.fmt(worst["optimizer_bytes"] / mib, 1),
                common.fmt(r["model_state_bytes"] / mib, 1),
                common.fmt(r["peak_bytes"] / mib, 1),
                common.fmt(r["step_s"] * 1e3, 1),
            ]
        )
    params = p["params"]
    first = next(iter(p["strategies"].values()))
    notes = [f"{first['num_params']:,} parameters; peak: {first['ranks'][0]['peak_kind']}"]
    if params.get("accumulate", 1) > 1:
        notes.append(f"train.accumulate={params['accumulate']}: grads = the most held at a micro-batch boundary")
    for s, r in p["strategies"].items():
        if s == "fsdp":
            share = r["grad_bytes"] / (4 * r["num_params"])
            notes.append(
                f"fsdp gradient bytes per rank / the whole fp32 gradient = {share:.3f} (1/N = {1 / params['world']:.3f})"
            )
    if "fsdp_over_ddp" in p:
        notes.append(
            f"fsdp_over_ddp (model state per rank) = {p['fsdp_over_ddp']:.3f} (target <= 1/N + 0.1 = "
            f"{p['target']:.3f}); grads {p['fsdp_over_ddp_grads']:.3f}; peak {p['fsdp_over_ddp_peak']:.2f}x, "
            f"step time {p['fsdp_over_ddp_step_time']:.2f}x"
        )
    a = p["activations"]
    ratio = "n/a" if a["ratio"] is None else f"{a['ratio']:.3f}"
    return "\n".join(
        [
            common.table(
                f"memory per rank, {params['world']} rank(s), {params['depth']} blocks of width {params['width']}",
                ["strategy", "params MiB", "grads MiB", "optimizer MiB", "model state MiB", "peak MiB", "step ms"],
                rows,
                notes,
            ),
            common.table(
                f"activation memory of one step, {a['model']}, batch {a['batch']} ({a['kind']})",
                ["activation_checkpoint", "MiB"],
                [["false", common.fmt(a["bytes_off"] / mib, 2)], ["true", common.fmt(a["bytes_on"] / mib, 2)]],
                [f"ratio (true / false) = {ratio}"],
            ),
        ]
    )
