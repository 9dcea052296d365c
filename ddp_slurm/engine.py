"""The pieces of training that the loop and the benchmarks share: optimizer, schedule, step, evaluation.

The step is written for speed on small models, where framework overhead rivals the math: gradients
are dropped (``set_to_none``) instead of zeroed, the optimizer uses the multi-tensor (``foreach``)
path, and nothing in it waits for the device (the loss stays a tensor; the caller syncs when it
logs).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import TrainConfig
from .data import Split, eval_shard, normalize


def make_optimizer(cfg: TrainConfig, params, device: torch.device) -> torch.optim.Optimizer:
    # fused kernels exist for CUDA; on CPU the foreach (multi-tensor) path is the fast one.
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fast)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fast)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay, **fast)


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    if cfg.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, total_steps=max(total_steps, 2),
                                                   pct_start=0.25, cycle_momentum=False)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, images: torch.Tensor,
              labels: torch.Tensor, precision: str = "fp32") -> Callable[[torch.Tensor], torch.Tensor]:
    """Return ``step(indices) -> loss`` training on ``images[indices]`` (data already on the device)."""
    device = images.device
    cast = autocast(device, precision)

    def step(indices: torch.Tensor) -> torch.Tensor:
        x = normalize(images.index_select(0, indices))
        y = labels.index_select(0, indices)
        with cast:
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.detach()

    return step


@torch.no_grad()
def evaluate(model: nn.Module, test: Split, rank: int, world_size: int, precision: str = "fp32",
             batch: int = 256) -> tuple[float, int, float]:
    """Exact distributed evaluation: every test image counted once whatever the world size.

    ``model`` must be the bare module, not the DDP wrapper: ranks hold shards of unequal size and
    DDP's per-forward buffer broadcast would pair up mismatched calls. Returns (accuracy, images, loss).
    """
    was_training = model.training
    model.eval()
    start, stop = eval_shard(len(test), rank, world_size)
    device = test.images.device
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct, count, summed loss
    with autocast(device, precision):
        for i in range(start, stop, batch):
            x = normalize(test.images[i:min(i + batch, stop)])
            y = test.labels[i:min(i + batch, stop)]
            logits = model(x).float()
            totals[0] += (logits.argmax(1) == y).sum()
            totals[1] += y.numel()
            totals[2] += F.cross_entropy(logits, y, reduction="sum")
    if world_size > 1:
        dist.all_reduce(totals)
    model.train(was_training)
    correct, count, loss_sum = totals.tolist()
    return correct / max(count, 1), int(count), loss_sum / max(count, 1)
