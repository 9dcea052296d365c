"""The two example models. Both take standardised images ``float32 [B, 1, 28, 28]``."""
from __future__ import annotations

import torch
from torch import nn

MODELS = ("mlp", "cnn")


class MLP(nn.Sequential):
    """784-100-10 with ReLU: the seed documents' model."""

    def __init__(self) -> None:
        super().__init__(nn.Flatten(), nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))

    def flops_per_sample(self) -> int:
        """Multiply-adds x 2 of one forward pass (training is ~3x this)."""
        return 2 * (784 * 100 + 100 * 10)


class CNN(nn.Sequential):
    """A small convnet in the spirit of the MNIST speed records: two conv blocks with batch norm,
    then a linear head. Small enough that an epoch of the sample takes about a second on two cores."""

    def __init__(self, width: int = 24) -> None:
        w = width
        super().__init__(
            nn.Conv2d(1, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2),  # 14x14
            nn.Conv2d(w, 2 * w, 3, padding=1, bias=False), nn.BatchNorm2d(2 * w), nn.ReLU(), nn.MaxPool2d(2),  # 7x7
            nn.Conv2d(2 * w, 4 * w, 3, padding=1, bias=False), nn.BatchNorm2d(4 * w), nn.ReLU(),
            nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(4 * w, 10),
        )
        self.width = w

    def flops_per_sample(self) -> int:
        w = self.width
        convs = 28 * 28 * w * 9 + 14 * 14 * (2 * w) * w * 9 + 7 * 7 * (4 * w) * (2 * w) * 9
        return 2 * (convs + 4 * w * 10)


def build(name: str) -> nn.Module:
    if name == "mlp":
        return MLP()
    if name == "cnn":
        return CNN()
    raise ValueError(f"unknown model {name!r}: expected one of {', '.join(MODELS)}")
