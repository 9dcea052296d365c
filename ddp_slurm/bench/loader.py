"""``bench loader``: ddp_slurm's training step against the seed-style pipeline, side by side.

(a) seed-style: ``torchvision.datasets.MNIST`` (the real class, reading the bundled sample unpacked into
the layout it expects) + ``ToTensor`` + ``Normalize`` + ``DataLoader``: each sample becomes a PIL image
and then a float tensor, one at a time, and every batch is collated and copied to the device.
(b) ddp_slurm: the runtime's step (MNIST task) on the training set held as uint8 on the device; a batch is one
gather and one normalisation.

Same model architecture and initial weights, same optimizer (Adam, same learning rate: the seed with
torch's default settings, ddp_slurm with ``engine.make_optimizer``), same batch size, same number of
samples per round; rounds alternate A B A B after a warm-up of both, so a change in the machine's load
hits both alike.
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ddp_slurm import config
from ddp_slurm.bench import common
from ddp_slurm.tasks.mnist import data, models

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=models.MODELS, default="mlp")
    p.add_argument("--batch", type=int, default=128, help="batch size of both pipelines (default 128)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--rounds", type=int, default=7, help="A B rounds after the warm-up (default 7)")
    p.add_argument(
        "--samples",
        type=int,
        default=4992,
        help="samples each pipeline trains per round, rounded down to full batches (default: one epoch)",
    )
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps of each pipeline (default 10)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="DataLoader worker processes of the seed pipeline (default 0: on a few cores, "
        "workers compete with the training step for them)",
    )


def write_torchvision_layout(root: Path) -> Path:
    """Unpack the bundled sample to ``root/MNIST/raw/*-ubyte``, where ``torchvision.datasets.MNIST`` reads."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    folder = resources.files("ddp_slurm") / "assets" / "mnist-sample"
    for name in IDX_FILES:
        (raw / name).write_bytes(gzip.decompress((folder / f"{name}.gz").read_bytes()))
    return root


def seed_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """The configured optimizer with torch's default settings, as a seed-style script constructs it."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True)


class SeedPipeline:
    """The loop of the seed documents and pytorch/examples' MNIST, with its data pipeline."""

    def __init__(
        self,
        root: Path,
        model_name: str,
        optimizer: str,
        batch: int,
        lr: float,
        device: torch.device,
        workers: int,
        seed: int,
    ) -> None:
        from torch.utils.data import DataLoader
        from torchvision import datasets, transforms

        tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((data.MEAN,), (data.STD,))])
        dataset = datasets.MNIST(str(root), train=True, download=False, transform=tf)
        self.loader = DataLoader(
            dataset,
            batch_size=batch,
            shuffle=True,
            drop_last=True,
            num_workers=workers,
            pin_memory=device.type == "cuda",
        )
        torch.manual_seed(seed)
        self.model = models.build(model_name).to(device)
        self.optimizer = seed_optimizer(optimizer, self.model.parameters(), lr)
        self.device = device

    def run(self, steps: int) -> None:
        done = 0
        while done < steps:
            for x, y in self.loader:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                self.optimizer.zero_grad()
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                self.optimizer.step()
                done += 1
                if done == steps:
                    return


class FastPipeline:
    """ddp_slurm's step, fed the way ``ddp_slurm.train`` feeds it (one rank, the MNIST task, in memory)."""

    def __init__(self, cfg: config.Config, batch: int, device: torch.device, total_steps: int, seed: int) -> None:
        self.model, optimizer, self.step, _, self.batches = common.mnist_trainer(cfg.model.name, batch, 0, 1, device)
        self.optimizer_path = "fused" if optimizer.defaults.get("fused") else "foreach"

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step(next(self.batches))


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    device = common.resolve_device(args.device)
    if args.batch < 1 or args.batch > data.TRAIN_SIZES["sample"]:
        raise common.BenchError(f"--batch {args.batch}: expected 1 to {data.TRAIN_SIZES['sample']}")
    steps = max(1, args.samples // args.batch)
    cfg = config.load(overrides=[f"model.name={args.model}", f"train.global_batch_size={args.batch}"])
    with tempfile.TemporaryDirectory(prefix="ddp_slurm-bench-") as tmp:
        seed_style = SeedPipeline(
            write_torchvision_layout(Path(tmp)),
            args.model,
            cfg.train.optimizer,
            args.batch,
            cfg.train.lr,
            device,
            args.workers,
            cfg.run.seed,
        )
        fast = FastPipeline(cfg, args.batch, device, args.warmup + args.rounds * steps, cfg.run.seed)
        seed_style.run(args.warmup)
        fast.run(args.warmup)
        rates: dict[str, list[float]] = {"seed": [], "ddp_slurm": []}
        for _ in range(args.rounds):
            for name, pipe in (("seed", seed_style), ("ddp_slurm", fast)):
                rates[name].append(steps * args.batch / common.timed(lambda: pipe.run(steps), device))
    a, b = common.summary(rates["seed"]), common.summary(rates["ddp_slurm"])
    payload = common.header(
        "loader",
        device,
        threads,
        model=args.model,
        batch=args.batch,
        rounds=args.rounds,
        samples_per_round=steps * args.batch,
        warmup_steps=args.warmup,
        workers=args.workers,
        optimizer=f"{cfg.train.optimizer} lr {cfg.train.lr:g} (ddp_slurm: {fast.optimizer_path})",
    )
    payload.update(
        {
            "seed_samples_per_s": a,
            "ddp_slurm_samples_per_s": b,
            "ratio": b["median"] / a["median"],
            "ratio_per_round": [y / x for x, y in zip(rates["seed"], rates["ddp_slurm"])],
        }
    )
    return payload


def render(p: dict[str, Any]) -> str:
    q = p["params"]
    title = (
        f"bench loader: {q['model']}, batch {q['batch']}, {p['device']}, {p['threads']} thread(s); "
        f"{q['rounds']} rounds of {q['samples_per_round']:,} samples each, A B A B after a warm-up"
    )
    rows = [
        [
            "(a) seed-style: torchvision MNIST + ToTensor + Normalize + DataLoader",
            *common.fmt_spread(p["seed_samples_per_s"]),
        ],
        ["(b) ddp_slurm: runtime step, uint8 data on the device", *common.fmt_spread(p["ddp_slurm_samples_per_s"])],
    ]
    notes = [
        f"ratio (b)/(a) of the medians: {p['ratio']:.1f}x  "
        f"(per round: {', '.join(f'{r:.1f}' for r in p['ratio_per_round'])})",
        f"same model and initial weights; optimizer {q['optimizer']}, the seed with torch's defaults; "
        f"DataLoader workers={q['workers']}; load average {p['machine']['load_average_1m']}",
    ]
    return common.table(title, ["pipeline", "samples/s median", "min-max", "spread"], rows, notes)
