"""Is ``torch.compile`` worth a ``train.compile`` key? Eager against compiled on the addition example.

    python benchmarks/compile_addition.py [--device cpu|cuda] [--steps 200] [--pairs 3] [--mode default]

The addition example's model (examples/addition: a 2-layer transformer encoder, width 64, dropout 0.1),
its loss, Adam and batch 128, on random digit sequences (the time of a step does not depend on the
digits). Prints the compilation time (the first steps of the compiled model, which every launch and
requeue of a run would pay again) and the steady samples/s of each, measured in alternating pairs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.addition.task import Adder, sequence_length  # noqa: E402

DIGITS, WIDTH, LAYERS, DROPOUT, BATCH = 3, 64, 2, 0.1, 128


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def trainer(compiled: bool, device: torch.device, mode: str):
    torch.manual_seed(0)
    model = Adder(DIGITS, WIDTH, LAYERS, DROPOUT).to(device)
    forward = torch.compile(model, mode=mode) if compiled else model
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 10, (BATCH, sequence_length(DIGITS)), device=device)
    answer = torch.randint(0, 10, (BATCH, DIGITS + 1), device=device)

    def steps(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(n):
            loss = F.cross_entropy(forward(tokens).flatten(0, 1), answer.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        sync(device)
        return time.perf_counter() - start

    return steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--mode", default="default", help="torch.compile mode (default, reduce-overhead, max-autotune)")
    args = p.parse_args()
    device = torch.device(args.device)
    eager, compiled = trainer(False, device, args.mode), trainer(True, device, args.mode)
    eager(3)
    first = compiled(3)  # compilation happens here
    rates: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.pairs):
        rates["eager"].append(args.steps * BATCH / eager(args.steps))
        rates["compiled"].append(args.steps * BATCH / compiled(args.steps))
    e, c = statistics.median(rates["eager"]), statistics.median(rates["compiled"])
    print(f"torch {torch.__version__} on {device}, addition example (width {WIDTH}, {LAYERS} layers), batch {BATCH}")
    print(f"compilation (first 3 steps of the compiled model): {first:.1f} s")
    print(f"eager     {e:10,.0f} samples/s  (pairs: {', '.join(f'{r:,.0f}' for r in rates['eager'])})")
    print(f"compiled  {c:10,.0f} samples/s  (pairs: {', '.join(f'{r:,.0f}' for r in rates['compiled'])})")
    print(
        f"compiled / eager: {c / e:.2f}; compilation pays for itself after {first / max(1e-9, BATCH / e - BATCH / c):,.0f} steps"
        if c > e
        else f"compiled / eager: {c / e:.2f}: slower, compilation never pays for itself"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
