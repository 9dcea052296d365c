"""``dist.strategy``: how the model is spread over the ranks, chosen once per launch, asked everywhere else.

A ``Strategy`` owns every difference between DDP and FSDP2 that the runtime has: how the model is
wrapped, how evaluation batches are laid out, where a checkpoint's state lives (its backend: one file
written by rank 0, or a folder of every rank's shards), how a full state dict is loaded into the model
(a warm start), and what a CUDA graph can capture. ``of(name)`` is the one place that maps the config's
value to one; nothing else in the runtime compares ``dist.strategy`` or asks which strategy it has.

- ``DDP`` (``train/ddp.py``): every rank holds the whole model; DistributedDataParallel averages the
  gradients (no wrapper for one process); checkpoints are whole files.
- ``FSDP`` (``train/fsdp.py``): FSDP2 shards the parameters, gradients and optimizer state over the
  ranks (``Task.shard_units``); every forward is a collective, so evaluation pads the ranks with fewer
  batches; checkpoints are folders of shards. Weights in channels_last layout are made contiguous first:
  DTensor cannot shard them (convolutions still run on channels_last activations).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from ddp_slurm.train import activation
from ddp_slurm.train.checkpoint.backends import Backend, Sharded, WholeFile


class Strategy:
    """One way of spreading the model over the ranks (see the module docstring)."""

    name: ClassVar[str]
    backend: ClassVar[Backend]
    captures_graphs: ClassVar[bool] = False  # train.cuda_graphs can capture its step
    scales_fp16: ClassVar[bool] = False  # train.precision=fp16: its ranks agree on each step the scaler skips

    def wrap(
        self,
        model: nn.Module,
        task: Any,
        device: torch.device,
        precision: str,
        world_size: int,
        *,
        activation_checkpoint: bool = False,
        group: Any = None,
    ) -> nn.Module:
        """``model`` (on ``device``, the same weights on every rank) made ready; returns the module the step
        calls. Called before the optimizer is built. ``activation_checkpoint``: the task's ``shard_units``
        recompute their forward in backward (``activation.py``), under either strategy. ``group``: the
        training group (``Groups.train``; None: the default group)."""
        raise NotImplementedError

    def eval_batches(
        self, batches: Iterator[Any], data: Any, device: torch.device, rank: int, world: int, batch: int
    ) -> Iterator[Any]:
        """This rank's evaluation batches as the strategy needs them run."""
        return batches

    def load_whole(self, model: nn.Module, optimizer: Any, state: dict[str, Any], with_optimizer: bool) -> None:
        """A whole (unsharded) checkpoint's model, and with ``with_optimizer`` its optimizer's per-parameter
        state, into this run's (possibly sharded) model and optimizer: a warm start."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(model, state["model"], options=options)
        if with_optimizer:
            own = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
            own["state"] = _by_name(state["optimizer"], model, optimizer)
            set_optimizer_state_dict(model, optimizer, own, options=options)


def _by_name(saved: dict[str, Any], model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """A saved optimizer's per-parameter state keyed by parameter name, as ``get_state_dict`` keys it: a
    sharded checkpoint's already is; a whole file's is keyed by position in the optimizer's groups, which
    the gate has checked to be this run's (``fit``)."""
    state = saved["state"]
    if all(isinstance(k, str) for k in state):
        return dict(state)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {order[index]: entry for index, entry in state.items()}


class DDP(Strategy):
    name, backend, captures_graphs = "ddp", WholeFile(), True
    scales_fp16 = True  # the gradients are all-reduced before the scaler checks them: every rank sees the same

    def wrap(
        self,
        model: nn.Module,
        task: Any,
        device: torch.device,
        precision: str,
        world_size: int,
        *,
        activation_checkpoint: bool = False,
        group: Any = None,
    ) -> nn.Module:
        from ddp_slurm.train.ddp import wrap_ddp

        if activation_checkpoint:
            activation.checkpoint_units(task.shard_units(model))
        return wrap_ddp(model, device, world_size, settle=True, group=group)


class FSDP(Strategy):
    name, backend = "fsdp", Sharded()

    def wrap(
        self,
        model: nn.Module,
        task: Any,
        device: torch.device,
        precision: str,
        world_size: int,
        *,
        activation_checkpoint: bool = False,
        group: Any = None,
    ) -> nn.Module:
        from ddp_slurm.train import fsdp

        for p in model.parameters():
            if p.dim() == 4 and not p.is_contiguous():  # channels_last: DTensor shards only contiguous weights
                p.data = p.data.contiguous()
        units = task.shard_units(model)
        if activation_checkpoint:
            activation.checkpoint_units(units)
        return fsdp.shard(model, units, device, precision, group)  # shards in place

    def eval_batches(
        self, batches: Iterator[Any], data: Any, device: torch.device, rank: int, world: int, batch: int
    ) -> Iterator[Any]:
        from ddp_slurm.train import fsdp

        return fsdp.padded(batches, data, device, rank, world, batch)


STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDP, "fsdp": FSDP}


def of(name: str) -> Strategy:
    """The strategy ``dist.strategy`` names."""
    return STRATEGIES[name]()
