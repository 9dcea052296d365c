"""MNIST as a task: the bundled sample or full MNIST, a 784-100-10 MLP or a small CNN.

It uses only what ``ddp_slurm.train.task`` offers every task: its own config sections (``data.*``,
``model.*``), the in-memory fast path (uint8 images held on the device, normalised per batch), and the
runtime's optimizer, schedule, evaluation and checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ddp_slurm.config import ConfigError, checked
from ddp_slurm.shards import decode
from ddp_slurm.shards.dataset import Shards
from ddp_slurm.tasks.mnist import data, models
from ddp_slurm.train.task import Task, Tensors


@dataclass
class DataConfig:
    source: Literal["sample", "mnist", "shards"] = "sample"
    """``sample``: the 5,000/5,000 MNIST subset bundled with the package (offline); ``mnist``: full MNIST;
    ``shards``: WebDataset shards under ``<root>/train`` and ``<root>/test`` (``ddp-slurm data write
    task=ddp_slurm.tasks.mnist:MNIST --out <root>/train``, and ``--split eval --out <root>/test``)."""
    root: str = checked("data", resumable=True)
    """Where full MNIST lives (``<root>/MNIST/raw``), or the shards (``shards``); unused for ``sample``."""
    download: bool = checked(True, resumable=True)
    """For ``mnist``: rank 0 downloads missing files (others wait). Off on compute nodes without internet."""


@dataclass
class ModelConfig:
    name: Literal["mlp", "cnn"] = "cnn"
    """``mlp``: 784-100-10 with ReLU, the classic MNIST baseline; ``cnn``: a small, fast convnet (the default)."""


@dataclass
class MNISTConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)


class MNIST(Task):
    """Digit classification; evaluation reports ``accuracy`` and ``loss`` over the whole test split."""

    Config = MNISTConfig
    config: MNISTConfig
    best_metric = "accuracy"

    def check(self) -> None:
        source = self.config.data.source
        size = data.TRAIN_SIZES[source] if source != "shards" else len(self._split(train=True))
        if self.ctx.global_batch_size > size:
            raise ConfigError(
                f"train.global_batch_size={self.ctx.global_batch_size} is larger than the "
                f"{self.config.data.source} training set ({size})"
            )
        if self.config.data.source == "mnist" and not self.config.data.download:
            try:  # missing and not to be downloaded: say so before anything starts
                data.ensure_mnist(Path(self.config.data.root), allow_download=False, is_main=True)
            except data.DataError as exc:
                raise ConfigError(str(exc)) from None

    def prepare_data(self) -> None:
        if self.config.data.source == "mnist":
            data.ensure_mnist(Path(self.config.data.root), self.config.data.download, is_main=True)

    def build_model(self) -> nn.Module:
        return models.build(self.config.model.name)

    def _split(self, train: bool) -> Tensors | Shards:
        if self.config.data.source == "shards":  # read by byte range, in the order of shards/order.py
            return Shards(Path(self.config.data.root) / ("train" if train else "test"), decode.tensors)
        split = data.load_split(self.config.data.source, self.config.data.root, train=train)
        return Tensors(split.images, split.labels)

    def train_data(self) -> Tensors | Shards:
        return self._split(train=True)

    def training_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(data.normalize(images)), labels)

    def eval_data(self) -> Tensors | Shards:
        return self._split(train=False)

    def eval_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, labels = batch
        logits = model(data.normalize(images)).float()
        return {
            "accuracy": (logits.argmax(1) == labels).sum(),
            "loss": F.cross_entropy(logits, labels, reduction="sum"),
        }
