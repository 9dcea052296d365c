"""``bench loader``: ddp_slurm's training step against the seed-style pipeline, side by side.

(a) seed-style: ``torchvision.datasets.MNIST`` (the real class, reading the bundled sample unpacked into
the layout it expects) + ``ToTensor`` + ``Normalize`` + ``DataLoader``: each sample becomes a PIL image
and then a float tensor, one at a time, and every batch is collated and copied to the device.
(b) ddp_slurm: the runtime's step (MNIST task) on the training set held as uint8 on the device; a batch is one
gather and one normalisation.
(c) with ``--dataset-path``: the runtime's Dataset path (``loader.DatasetBatches``: DataLoader worker
processes, per-sample seeding for exact resume, pinned memory and prefetch) over a map-style ``Dataset``
of the same uint8 images, feeding the same step: what a task whose data does not fit in memory pays.

Same model architecture and initial weights, same optimizer (Adam, same learning rate: the seed with
torch's default settings, ddp_slurm with ``optim.make_optimizer``), same batch size, same number of
samples per round; rounds alternate A B A B after a warm-up of both, so a change in the machine's load
hits both alike (A B C with ``--dataset-path``).
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
from ddp_slurm.bench import common, flags
from ddp_slurm.tasks.mnist import data, models
from ddp_slurm.train.optim import make_optimizer, make_scheduler

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=models.MODELS, default="mlp")
    p.add_argument("--batch", type=flags.batch(), default=128, help="batch size of both pipelines (default 128)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--rounds", type=flags.count(), default=7, help="A B rounds after the warm-up (default 7)")
    p.add_argument(
        "--samples",
        type=flags.steps(),
        default=4992,
        help="samples each pipeline trains per round, rounded down to full batches (default: one epoch)",
    )
    p.add_argument("--warmup", type=flags.steps(0), default=10, help="warm-up steps of each pipeline (default 10)")
    p.add_argument(
        "--workers",
        type=flags.per_cpu(0),
        default=0,
        help="DataLoader worker processes of the seed pipeline (default 0: on a few cores, "
        "workers compete with the training step for them)",
    )
    p.add_argument(
        "--dataset-path",
        action="store_true",
        help="also measure (c): the runtime's Dataset path (DataLoader workers) on the same model and data",
    )
    p.add_argument(
        "--dataset-workers",
        type=flags.per_cpu(0),
        default=2,
        help="worker processes of the Dataset path (default 2: the runtime's train.workers default)",
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


class ImageSamples(torch.utils.data.Dataset):
    """The training images as a map-style Dataset: ``(uint8 image, label)`` per index, as a task whose
    data does not fit in memory would return them from disk."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class DatasetPipeline:
    """The same step fed through the runtime's Dataset path: ``DatasetBatches`` with worker processes."""

    def __init__(self, cfg: config.Config, batch: int, device: torch.device, workers: int, prefetch: int) -> None:
        from ddp_slurm.train import loader, step

        task = cfg_task(cfg, batch, device)
        train = task.train_data()
        self.batches = loader.DatasetBatches(
            ImageSamples(*train.tensors), device, cfg.run.seed, batch, 0, 1, workers=workers, prefetch=prefetch
        )
        torch.manual_seed(cfg.run.seed)
        model = task.build_model().to(device)
        optimizer = make_optimizer(cfg.train, model.parameters(), device)
        scheduler = make_scheduler(cfg.train, optimizer, 10**9)
        self.step = step.make_step(model, optimizer, scheduler, task.training_step, device, cfg.train.precision)
        self.epoch, self.iterator = 0, self.batches.epoch(0, 0)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            batch = next(self.iterator, None)
            if batch is None:  # the epoch ended: the next one, as the training loop does
                self.epoch += 1
                self.iterator = self.batches.epoch(self.epoch, 0)
                batch = next(self.iterator)
            self.step(batch)


def cfg_task(cfg: config.Config, batch: int, device: torch.device):
    """The MNIST task of ``cfg`` on one rank."""
    from ddp_slurm.tasks.mnist import MNIST
    from ddp_slurm.train.task import Context

    return MNIST(cfg.task_config, Context(0, 1, 0, device, cfg.run.seed, Path(cfg.run.output_root), batch))


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    device = common.resolve_device(args.device)
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
        pipes: dict[str, Any] = {"seed": seed_style, "ddp_slurm": fast}
        if args.dataset_path:
            pipes["dataset"] = DatasetPipeline(cfg, args.batch, device, args.dataset_workers, cfg.train.prefetch)
        for pipe in pipes.values():
            pipe.run(args.warmup)
        rates: dict[str, list[float]] = {name: [] for name in pipes}
        for _ in range(args.rounds):
            for name, pipe in pipes.items():
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
        dataset_workers=args.dataset_workers if args.dataset_path else None,
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
    if args.dataset_path:
        c = common.summary(rates["dataset"])
        payload.update(
            {
                "dataset_samples_per_s": c,
                "dataset_vs_seed": c["median"] / a["median"],
                "dataset_vs_memory": c["median"] / b["median"],
                "dataset_vs_seed_per_round": [z / x for x, z in zip(rates["seed"], rates["dataset"])],
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
    if "dataset_samples_per_s" in p:
        rows.append(
            [
                f"(c) ddp_slurm Dataset path: runtime step, DataLoader with {q['dataset_workers']} worker(s)",
                *common.fmt_spread(p["dataset_samples_per_s"]),
            ]
        )
    notes = [
        f"ratio (b)/(a) of the medians: {p['ratio']:.1f}x  "
        f"(per round: {', '.join(f'{r:.1f}' for r in p['ratio_per_round'])})",
        *(
            [
                f"ratio (c)/(a): {p['dataset_vs_seed']:.1f}x, (c)/(b): {p['dataset_vs_memory']:.2f}x  "
                f"(Dataset path vs seed-style, vs in-memory)"
            ]
            if "dataset_samples_per_s" in p
            else []
        ),
        f"same model and initial weights; optimizer {q['optimizer']}, the seed with torch's defaults; "
        f"DataLoader workers={q['workers']}; load average {p['machine']['load_average_1m']}",
    ]
    return common.table(title, ["pipeline", "samples/s median", "min-max", "spread"], rows, notes)
