"""A tiny transformer that learns to add two 3-digit numbers: a ddp_slurm task outside the package.

Nothing here is special to the runtime: it is imported by path, like a user's code::

    python -m ddp_slurm.train task=examples/addition/task.py:Addition run.name=add

What it shows beyond the MNIST task:

- data on disk, generated (no download) by ``prepare_data`` on rank 0: a token file written
  atomically, deterministic from ``data.seed``, read through a map-style ``Dataset`` (the runtime's
  Dataset path: DataLoader workers, prefetch, pinned memory);
- randomness in the data (``data.swap_prob``: ``a+b`` shown as ``b+a``) and in the model (dropout),
  both of which resume bit-identically after a stop;
- config sections of its own with value checks (``checked``), and an evaluation that reports
  exact-match ``accuracy`` (all answer digits right) and the per-digit ``loss`` as sums.

The problem: ``a+b=`` (most significant digit first) followed by ``DIGITS + 1`` query tokens; the
model (a bidirectional ``nn.TransformerEncoder``) fills each query position with one digit of the
sum, all at once. The held-out pairs never appear in the training set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ddp_slurm import ConfigError, Task, checked

PLUS, EQUALS, QUERY = 10, 11, 12
VOCAB = 13


@dataclass
class AdditionData:
    digits: int = checked(3, check=lambda v: 1 <= v <= 9, expected="an integer from 1 to 9")
    """Digits of each operand: ``a`` and ``b`` are drawn from [0, 10**digits)."""
    train_size: int = checked(50_000, check=lambda v: v >= 1, expected="an integer >= 1")
    """Training pairs (distinct from the held-out ones)."""
    test_size: int = checked(2_000, check=lambda v: v >= 1, expected="an integer >= 1")
    """Held-out pairs the evaluation scores (exact match)."""
    seed: int = 1234
    """Seed of the generated pairs (the file depends on it, not on ``run.seed``)."""
    root: str = checked("data/addition", check=bool, expected="a non-empty path", resumable=True)
    """Directory of the generated token files (relative to the working directory); shared by runs."""
    swap_prob: float = checked(0.5, check=lambda v: 0.0 <= v <= 1.0, expected="a number in [0, 1]")
    """Probability that a training sample is shown as ``b+a`` instead of ``a+b`` (augmentation)."""


@dataclass
class AdditionModel:
    width: int = checked(64, check=lambda v: v >= 8 and v % 4 == 0, expected="a multiple of 4, >= 8")
    """Embedding width (4 attention heads)."""
    layers: int = checked(2, check=lambda v: v >= 1, expected="an integer >= 1")
    """Transformer encoder layers."""
    dropout: float = checked(0.1, check=lambda v: 0.0 <= v < 1.0, expected="a number in [0, 1)")
    """Dropout in every layer (on in training, off in evaluation)."""


@dataclass
class AdditionConfig:
    data: AdditionData = field(default_factory=AdditionData)
    model: AdditionModel = field(default_factory=AdditionModel)


def sequence_length(digits: int) -> int:
    """``a`` ``+`` ``b`` ``=`` then one query per digit of the sum."""
    return 2 * digits + 2 + digits + 1


def digits_of(values: np.ndarray, width: int) -> np.ndarray:
    """Each value as ``width`` decimal digits, most significant first."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return (values[:, None] // powers) % 10


def generate(path: Path, digits: int, train_size: int, test_size: int, seed: int) -> None:
    """Write ``train_size + test_size`` distinct pairs as rows of ``a`` digits, ``b`` digits, sum digits
    (uint8), the held-out rows last. Atomic: a reader sees the whole file or none."""
    space = 10 ** (2 * digits)
    if train_size + test_size > space:
        raise ValueError(f"only {space} distinct pairs of {digits}-digit numbers")
    rng = np.random.default_rng(seed)
    pairs = rng.choice(space, size=train_size + test_size, replace=False)
    a, b = pairs // 10**digits, pairs % 10**digits
    rows = np.concatenate([digits_of(a, digits), digits_of(b, digits), digits_of(a + b, digits + 1)], axis=1)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(rows.astype(np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class AdditionSamples(Dataset):
    """Rows ``[start, stop)`` of the token file, read lazily (each worker maps the file itself)."""

    def __init__(self, path: Path, digits: int, start: int, stop: int, swap_prob: float = 0.0) -> None:
        self.path, self.digits, self.start, self.stop, self.swap_prob = path, digits, start, stop, swap_prob
        self._rows: np.ndarray | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def rows(self) -> np.ndarray:
        if self._rows is None:  # opened in the process that reads it (DataLoader workers are forked or spawned)
            self._rows = np.memmap(self.path, dtype=np.uint8, mode="r").reshape(-1, 3 * self.digits + 1)
        return self._rows

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _rows=None)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.digits
        row = torch.from_numpy(self.rows()[self.start + index].astype(np.int64))
        a, b, total = row[:d], row[d : 2 * d], row[2 * d :]
        if self.swap_prob and torch.rand(()) < self.swap_prob:  # seeded per sample by the runtime
            a, b = b, a
        tokens = torch.cat(
            [a, torch.tensor([PLUS]), b, torch.tensor([EQUALS]), torch.full((d + 1,), QUERY, dtype=torch.int64)]
        )
        return tokens, total


class Adder(nn.Module):
    """Token + position embeddings, a bidirectional transformer encoder, a digit head on the queries."""

    def __init__(self, digits: int, width: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.answer = digits + 1
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(sequence_length(digits), width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, dropout=dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, digits + 1, 10)`` of the sum's digits."""
        h = self.encoder(self.embed(tokens) + self.position)
        return self.head(self.norm(h[:, -self.answer :]))


class Addition(Task):
    """3-digit addition; evaluation: ``accuracy`` (whole sum right) and ``loss`` (per digit)."""

    Config = AdditionConfig
    config: AdditionConfig
    best_metric = "accuracy"

    def check(self) -> None:
        d = self.config.data
        if d.train_size + d.test_size > 10 ** (2 * d.digits):
            raise ConfigError(
                f"data.train_size + data.test_size = {d.train_size + d.test_size} exceeds the "
                f"{10 ** (2 * d.digits)} distinct pairs of {d.digits}-digit numbers"
            )
        if self.ctx.global_batch_size > d.train_size:
            raise ConfigError(
                f"train.global_batch_size={self.ctx.global_batch_size} is larger than data.train_size={d.train_size}"
            )

    @property
    def path(self) -> Path:
        d = self.config.data
        return Path(d.root) / f"add{d.digits}-train{d.train_size}-test{d.test_size}-seed{d.seed}.u8"

    def prepare_data(self) -> None:
        if not self.path.exists():
            d = self.config.data
            generate(self.path, d.digits, d.train_size, d.test_size, d.seed)

    def build_model(self) -> nn.Module:
        m, d = self.config.model, self.config.data
        return Adder(d.digits, m.width, m.layers, m.dropout)

    def train_data(self) -> Dataset:
        d = self.config.data
        return AdditionSamples(self.path, d.digits, 0, d.train_size, d.swap_prob)

    def training_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, total = batch
        return F.cross_entropy(model(tokens).flatten(0, 1), total.flatten())

    def eval_data(self) -> Dataset:
        d = self.config.data
        return AdditionSamples(self.path, d.digits, d.train_size, d.train_size + d.test_size)

    def eval_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        tokens, total = batch
        logits = model(tokens).float()
        right = (logits.argmax(-1) == total).all(dim=1)
        per_digit = F.cross_entropy(logits.flatten(0, 1), total.flatten(), reduction="none").view(total.shape)
        return {"accuracy": right.sum(), "loss": per_digit.mean(dim=1).sum()}
