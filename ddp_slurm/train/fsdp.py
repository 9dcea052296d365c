"""``dist.strategy=fsdp``: the model, its gradients and the optimizer state sharded over the ranks (FSDP2).

PyTorch's own engine does the work (``torch.distributed.fsdp.fully_shard``): every unit the task names
(``Task.shard_units``; by default each direct child that holds parameters) becomes one FSDP unit whose
parameters are all-gathered just before its forward and backward and freed after; the root takes the
parameters no unit holds. Gradients are reduce-scattered, so each rank keeps 1/N of them and steps
the optimizer on its own shard: per-rank model state is about 1/N of DDP's (``bench memory``).

Choices, and why:
- units reshard after forward (the memory FSDP exists for), the root does not: its parameters are
  needed again at once by backward, so freeing them would only buy a second all-gather;
- ``train.precision=bf16``: parameters are gathered in bf16 and gradients reduced in fp32 (the
  mixed-precision policy FSDP2 documents); fp32 otherwise. Batch norm is the exception: each one is
  sharded on its own, first, with an fp32 policy (torchtitan#674's fix), because ``batch_norm`` refuses bf16
  weights beside its fp32 running statistics ("expected scalar type BFloat16 but found Float", on GPU and
  CPU alike) and its statistics must stay fp32 to resume exactly. Its fp32 weights take the bf16
  activations as they come, as under ddp's autocast; its few parameters cost one more all-gather each;
- the task's ``training_step`` and ``eval_step`` are the same as under DDP: the sharded module is
  called like the plain one.

Evaluation: every forward of a sharded model is a collective, so every rank must run as many eval
batches as the rank with the most; ranks with fewer run padding batches whose metrics are dropped
(``padded``), and each sample still counts exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_slurm.train import loader
from ddp_slurm.train.step import Padding

UNIT_RESHARD_AFTER_FORWARD = True
ROOT_RESHARD_AFTER_FORWARD = False


def shard(
    model: nn.Module, units: list[nn.Module], device: torch.device, precision: str, group: Any = None
) -> nn.Module:
    """Apply FSDP2 to each of ``units`` and then to ``model`` (in place), over ``group`` (the training group;
    None: the default group); returns ``model``.

    ``model`` must be on ``device`` with the same weights on every rank (built after the same seed):
    each rank keeps its slice of them. Build the optimizer afterwards (the parameters become DTensors).
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    inside = {id(m) for m in model.modules() if m is not model}
    for unit in units:
        if id(unit) not in inside:
            raise TypeError(
                f"shard_units() returned a {type(unit).__name__} that is not a submodule of the model "
                "(the model itself is always sharded last)"
            )
    if group is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    else:
        mesh = DeviceMesh.from_group(group, device.type)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    norms = batch_norms(model) if precision == "bf16" else []
    # the activation reaches it as under ddp's autocast (bf16, not cast up): same arithmetic, no fp32 copy
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for norm in norms:  # before the units that hold them: a unit leaves its sharded submodules' parameters alone
        fully_shard(norm, mesh=mesh, mp_policy=fp32, reshard_after_forward=UNIT_RESHARD_AFTER_FORWARD)
    sharded = {id(m) for m in norms}
    for unit in units:
        if id(unit) in sharded:  # a batch norm named as a unit (the default units of a Sequential): done above
            continue
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=UNIT_RESHARD_AFTER_FORWARD)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=ROOT_RESHARD_AFTER_FORWARD)
    return model


def batch_norms(model: nn.Module) -> list[nn.Module]:
    """Every batch norm of ``model`` that holds parameters (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, lazy
    ones: torch's ``_BatchNorm``), the model itself excepted (it is always sharded last, as the root)."""
    return [
        m
        for m in model.modules()
        if m is not model
        and isinstance(m, nn.modules.batchnorm._BatchNorm)
        and next(m.parameters(recurse=False), None) is not None
    ]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 module."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def padded(batches: Iterator[Any], data: Any, device: torch.device, rank: int, world: int, batch: int) -> Iterator[Any]:
    """This rank's evaluation batches, then ``Padding`` up to the count of the rank with the most.

    Each rank's shard is ``loader.eval_shard``, so every rank knows every count without asking. A
    padding batch repeats a real batch (this rank's last, or the data's first where this rank's shard
    is empty); ``step.evaluate`` runs it through the model (the collectives) and drops its metrics.
    """
    most = max(
        math.ceil(max(0, b - a) / batch) for a, b in (loader.eval_shard(len(data), r, world) for r in range(world))
    )
    last = None
    count = 0
    for last in batches:
        count += 1
        yield last
    if count < most and last is None:
        last = next(loader.eval_batches(data, device, 0, 1, batch, 0))
    for _ in range(most - count):
        yield Padding(last)
