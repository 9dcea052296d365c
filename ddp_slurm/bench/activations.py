"""Activation memory of one training step, with and without ``train.activation_checkpoint``.

Measured in this process on one model and one batch (the bench's stack of linear blocks, or a task's
model and its first training batch with ``--task``), each way from the same seed:

- CPU: the bytes autograd keeps for backward. A ``saved_tensors_hooks`` pack hook sees every tensor
  saved outside a checkpointed unit, and a forward pre-hook on each checkpointed unit sees its inputs
  (what the unit keeps to run its forward again); each storage is counted once (``untyped_storage``).
  Inside a unit, torch's own hooks replace saved tensors by handles, so they cost nothing until backward.
- CUDA: ``max_memory_allocated`` during forward and backward, above what was allocated before it
  (parameters, gradients of the warm-up step, the batch).

``ratio`` = bytes with it / bytes without it: the fraction of activation memory it keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddp_slurm.train import activation

Build = Callable[[], tuple[nn.Module, list[nn.Module], Any, Callable[[nn.Module, Any], torch.Tensor]]]


class SavedBytes:
    """Bytes of the distinct storages kept for backward while it is entered (CPU measure), other than the
    model's own parameters and buffers (they are kept whatever backward needs)."""

    def __init__(self, model: nn.Module, units: list[nn.Module]) -> None:
        own = [*model.parameters(), *model.buffers()]
        self.seen: set[int] = {t.untyped_storage().data_ptr() for t in own}
        self.bytes = 0
        self.units = units
        self._hooks: list[Any] = []
        self._saved: Any = None

    def add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()

    def __enter__(self) -> SavedBytes:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.add(t)
            return t

        def inputs(_module: nn.Module, args: tuple[Any, ...]) -> None:
            for a in args:
                self.add(a)

        self._hooks = [u.register_forward_pre_hook(inputs) for u in self.units]
        self._saved = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._saved.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._saved.__exit__(*exc)
        for h in self._hooks:
            h.remove()


def step_bytes(build: Build, device: torch.device, checkpointed: bool) -> int:
    """Activation bytes of one forward and backward of ``build()``'s model (after one warm-up step)."""
    torch.manual_seed(0)
    model, units, batch, loss_of = build()
    model.to(device).train()
    if checkpointed:
        activation.checkpoint_units(units)
    loss_of(model, batch).backward()  # warm-up: gradients exist, as in every later step
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss_of(model, batch).backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with SavedBytes(model, units if checkpointed else []) as saved:
        loss = loss_of(model, batch)
    loss.backward()
    return saved.bytes


def compare(build: Build, device: torch.device) -> dict[str, Any]:
    """Activation bytes without and with checkpointing of the units, and their ratio."""
    off = step_bytes(build, device, False)
    on = step_bytes(build, device, True)
    return {
        "kind": "cuda max_memory_allocated" if device.type == "cuda" else "saved tensors for backward",
        "bytes_off": off,
        "bytes_on": on,
        "ratio": on / off if off else None,
    }


def linear_stack(width: int, depth: int, batch: int, device: torch.device) -> Build:
    """The bench's model (``strategy_worker``'s stack of linear blocks, each one unit) and a batch."""

    def build() -> tuple[nn.Module, list[nn.Module], Any, Callable[[nn.Module, Any], torch.Tensor]]:
        blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
        model = nn.Sequential(*blocks, nn.Linear(width, 1))
        x = torch.randn(batch, width, device=device)
        y = torch.randn(batch, 1, device=device)
        return model, blocks, (x, y), lambda m, b: (m(b[0]) - b[1]).pow(2).mean()

    return build


def task_model(spec: str, batch: int, device: torch.device) -> Build:
    """A task's model (its ``shard_units``), its first ``batch`` training samples and its ``training_step``;
    rank 0 of one, its data prepared first."""
    from pathlib import Path

    from torch.utils.data import default_collate

    from ddp_slurm import config
    from ddp_slurm.train.task import Context, Tensors

    cfg = config.load(overrides=[f"task={spec}", f"train.global_batch_size={batch}"])
    task = config.task_class(spec)(
        cfg.task_config, Context(0, 1, 0, device, cfg.run.seed, Path(cfg.run.output_root), batch)
    )
    task.check()
    task.prepare_data()
    data = task.train_data()
    if isinstance(data, Tensors):
        sample: Any = tuple(t[:batch] for t in data.tensors)
    else:
        sample = default_collate([data[i] for i in range(batch)])
    sample = _to(sample, device)

    def build() -> tuple[nn.Module, list[nn.Module], Any, Callable[[nn.Module, Any], torch.Tensor]]:
        model = task.build_model()
        return model, task.shard_units(model), sample, task.training_step

    return build


def _to(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors, nested in tuples, lists and dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch
