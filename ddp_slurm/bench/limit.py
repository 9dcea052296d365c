"""``bench limit``: the training step's achieved fraction of this machine's compute-bound limit.

fraction = model FLOPs per training sample x samples/s / measured matmul FLOP/s.

FLOPs per sample follow the usual convention, 3x the forward pass (backward ~ 2x forward); the forward
is counted by torch's own ``FlopCounterMode`` (matmuls and convolutions, 2 per multiply-add). The FLOPs
of an actual forward+backward are counted as well and give a second, stricter-for-the-MLP figure: its
first layer needs no input gradient, so its training step is ~2x forward, not 3x.

The limit is the rate of an fp32 square matmul whose size does the same arithmetic per call as one
training step (2n^3 = the step's FLOPs), unless ``--matmul-size`` says otherwise. Why that size: a
matmul much smaller than the step's work is overhead-bound and would lower the bar; a much larger
one measures a blocking regime that the step's small GEMMs never reach, which says more about the
BLAS than about this training loop. That larger one (``--peak-size``, default 1024) is measured too
and reported as ``fraction_of_peak``, the stricter figure. Step and matmul windows alternate, and the
fractions are medians of per-round fractions, so a change in the machine's load hits both alike.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from ddp_slurm import argtypes, config
from ddp_slurm.bench import common, flags
from ddp_slurm.bench.pipeline_speed import FastPipeline
from ddp_slurm.tasks.mnist import models

MAX_WINDOW_S = 3600.0  # one measurement window
MAX_MATMUL = 1 << 16  # n of an n x n matmul (its memory is checked too)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=models.MODELS, default="mlp")
    p.add_argument("--batch", type=flags.batch(), default=128)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--rounds", type=flags.count(), default=5, help="alternating matmul / step rounds (default 5)")
    p.add_argument(
        "--seconds",
        type=argtypes.number(0, MAX_WINDOW_S, above=True),
        default=0.5,
        help="length of each measurement window (default 0.5)",
    )
    p.add_argument(
        "--matmul-size",
        type=argtypes.integer(1, MAX_MATMUL),
        default=None,
        help="n of the n x n matmul (default: the step's FLOPs per call, see the module doc)",
    )
    p.add_argument(
        "--peak-size",
        type=argtypes.integer(1, MAX_MATMUL),
        default=1024,
        help="n of a large matmul measured alongside, for the machine's peak (default 1024)",
    )


def forward_and_training_flops(model_name: str, batch: int) -> tuple[float, float]:
    """FLOPs per sample of one forward and of one forward+backward, counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    model = models.build(model_name)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as fwd:
        model(x)
    with FlopCounterMode(display=False) as both:
        F.cross_entropy(model(x), y).backward()
    return fwd.get_total_flops() / batch, both.get_total_flops() / batch


def auto_matmul_size(flops_per_step: float) -> int:
    n = round((flops_per_step / 2) ** (1 / 3) / 16) * 16
    return int(min(max(n, 64), 4096))


class MatmulRate:
    """FLOP/s of an fp32 n x n matmul, over windows of about ``seconds``."""

    def __init__(self, n: int, device: torch.device, seconds: float) -> None:
        self.n, self.device = n, device
        self.a, self.b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        self.out = torch.empty(n, n, device=device)
        self.calls = calibrate(self.one, device, seconds)

    def one(self) -> None:
        torch.mm(self.a, self.b, out=self.out)

    def measure(self) -> float:
        def many() -> None:
            for _ in range(self.calls):
                self.one()

        return 2 * self.n**3 * self.calls / common.timed(many, self.device)


def calibrate(fn, device: torch.device, seconds: float) -> int:
    """How many calls of ``fn`` fill about ``seconds`` (after one call to warm up)."""
    fn()
    one = common.timed(fn, device)
    return max(1, int(seconds / max(one, 1e-6)))


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    device = common.resolve_device(args.device)
    fwd, counted = forward_and_training_flops(args.model, args.batch)
    train_flops = 3 * fwd
    n = args.matmul_size or auto_matmul_size(train_flops * args.batch)
    # Each MatmulRate holds three n x n float32 matrices.
    flags.check_memory(f"--matmul-size {n} --peak-size {args.peak_size}", 12 * (n**2 + args.peak_size**2))
    limit_rate, peak_rate = MatmulRate(n, device, args.seconds), MatmulRate(args.peak_size, device, args.seconds)

    cfg = config.load(overrides=[f"model.name={args.model}", f"train.global_batch_size={args.batch}"])
    # The schedule's length only sets learning rates, which cost the same whatever they are.
    pipe = FastPipeline(cfg, args.batch, device, total_steps=10**9, seed=cfg.run.seed)
    pipe.run(10)
    steps = calibrate(lambda: pipe.run(5), device, args.seconds) * 5
    flops_rates, sample_rates, peak_rates = [], [], []
    for _ in range(args.rounds):
        flops_rates.append(limit_rate.measure())
        sample_rates.append(steps * args.batch / common.timed(lambda: pipe.run(steps), device))
        peak_rates.append(peak_rate.measure())
    fractions = [train_flops * s / f for s, f in zip(sample_rates, flops_rates)]
    fractions_counted = [counted * s / f for s, f in zip(sample_rates, flops_rates)]
    fractions_of_peak = [train_flops * s / f for s, f in zip(sample_rates, peak_rates)]
    payload = common.header(
        "limit",
        device,
        threads,
        model=args.model,
        batch=args.batch,
        rounds=args.rounds,
        matmul_size=n,
        peak_size=args.peak_size,
        window_s=args.seconds,
    )
    payload.update(
        {
            "forward_flops_per_sample": fwd,
            "training_flops_per_sample": train_flops,
            "counted_training_flops_per_sample": counted,
            "matmul_flops_per_s": common.summary(flops_rates),
            "samples_per_s": common.summary(sample_rates),
            "fraction_of_limit": common.summary(fractions)["median"],
            "fraction_per_round": fractions,
            "fraction_of_limit_counted": common.summary(fractions_counted)["median"],
            "peak_matmul_flops_per_s": common.summary(peak_rates),
            "fraction_of_peak": common.summary(fractions_of_peak)["median"],
        }
    )
    return payload


def render(p: dict[str, Any]) -> str:
    q = p["params"]
    mm, sps = p["matmul_flops_per_s"], p["samples_per_s"]
    title = (
        f"bench limit: {q['model']}, batch {q['batch']}, {p['device']}, {p['threads']} thread(s); "
        f"{q['rounds']} alternating rounds of ~{q['window_s']:g} s"
    )
    rows = [
        [f"matmul {q['matmul_size']}x{q['matmul_size']} fp32, GFLOP/s", *common.fmt_spread(common.scaled(mm, 1e-9), 1)],
        [
            f"matmul {q['peak_size']}x{q['peak_size']} fp32 (peak), GFLOP/s",
            *common.fmt_spread(common.scaled(p["peak_matmul_flops_per_s"], 1e-9), 1),
        ],
        ["training step, samples/s", *common.fmt_spread(sps)],
        [
            "training step, GFLOP/s (3x forward)",
            *common.fmt_spread(common.scaled(sps, p["training_flops_per_sample"] * 1e-9), 1),
        ],
    ]
    notes = [
        f"fraction of the compute-bound limit: {100 * p['fraction_of_limit']:.0f}% "
        f"(median of the per-round fractions: {', '.join(f'{100 * f:.0f}' for f in p['fraction_per_round'])})",
        f"FLOPs per sample: forward {p['forward_flops_per_sample']:,.0f}, training 3x forward = "
        f"{p['training_flops_per_sample']:,.0f}; counted forward+backward "
        f"{p['counted_training_flops_per_sample']:,.0f} -> "
        f"{100 * p['fraction_of_limit_counted']:.0f}% of the limit",
        f"against the large matmul's rate: {100 * p['fraction_of_peak']:.0f}%",
        f"load average {p['machine']['load_average_1m']}",
    ]
    return common.table(title, ["measurement", "median", "min-max", "spread"], rows, notes)
