"""Which process group carries what: device tensors on the training group, host tensors and pickled
objects on a host group.

NCCL's default group has a backend for CUDA tensors only: a CPU tensor (or a pickled object, which torch
sends as a CPU tensor where the group has a CPU backend) sent there fails with "No backend type associated
with device type cpu". Gloo carries both, so on CPU one group serves everything and a collective that
names no group works there while it would fail on every GPU cluster. The runtime therefore names the group
of every collective it makes:

- ``train``: the model's gradients and shards (DDP, FSDP2's mesh), the stop vote, the loss window, the
  evaluation totals and the buffers every rank takes from rank 0: tensors on the training device.
  ``None``: torch's default group, which carries them.
- ``host``: what lives in host memory: the checkpoint's agreed flags and RNG streams, the placement line,
  ``on_rank0``'s results, the evaluation's stop flags and metric names, Distributed Checkpoint's planning.
  A gloo group made beside a default group without a CPU backend (NCCL); ``None`` where the default group
  has one.

The groups made here wait as long as the default group does (``dist.timeout_s``, which ``init_distributed``
gives it), not torch's 30 minutes for a group made without a timeout.

``DDP_SLURM_NCCL_SHAPED=1`` (a test mode, for CPU runs) makes the default group one with a backend for CUDA
tensors only, as NCCL's is (``group.init_distributed``): the training and host groups are then two gloo
groups made here, distinct as on a GPU cluster, so that any collective left on the default group fails on
CPU as it would on GPUs. On CPU both carry CPU tensors, so a host tensor sent on the training group still
passes at run time; tests/test_groups_roles.py reads the package's source and fails on a collective that
names a group of the other role (or none), and traces an evaluation with tensors that claim the ``cuda``
device. The multi-rank tests run under the mode (tests/test_groups.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddp_slurm.errors import UsageError

if TYPE_CHECKING:  # torch is imported where a group is made: the tools' --help stays light
    import torch

NCCL_SHAPED = "DDP_SLURM_NCCL_SHAPED"


class GroupsError(UsageError):
    """A bad value of the test mode's variable (exit 2)."""


def nccl_shaped(environ: Mapping[str, str]) -> bool:
    """Whether ``DDP_SLURM_NCCL_SHAPED`` asks for a default group shaped like NCCL's ("1"; unset, "" or "0":
    no)."""
    value = environ.get(NCCL_SHAPED, "")
    if value not in ("", "0", "1"):
        raise GroupsError(f"{NCCL_SHAPED}={value!r} is not one of 0, 1: unset it (it is a test mode)")
    return value == "1"


def default_backend(backend: str, environ: Mapping[str, str] = os.environ) -> str:
    """The backend string the default group is made with: gloo as ``cuda:gloo`` under the test mode (a
    backend for CUDA tensors only, as NCCL's default group is), else ``backend`` as it is."""
    return "cuda:gloo" if backend == "gloo" and nccl_shaped(environ) else backend


@dataclass(frozen=True)
class Groups:
    """The groups a run's collectives name (see the module docstring); ``None``: torch's default group."""

    train: Any = None
    host: Any = None

    @classmethod
    def make(cls, device: torch.device) -> Groups:
        """Every rank, at the same point (making a group is a collective), once the default group exists:
        a gloo group for each role the default group cannot carry (two distinct ones where it carries
        neither, as under the test mode). Nothing is made where it carries both."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return cls()
        carried = {d.type for d in dist.group.WORLD._device_types}  # type: ignore[union-attr]
        train = None if device.type in carried else gloo_group()
        host = None if "cpu" in carried else gloo_group()
        return cls(train=train, host=host)


def default_timeout() -> timedelta:
    """The default group's timeout: the one ``init_distributed`` gave it (``dist.timeout_s``)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    backend = world._get_backend(world._device_types[0])  # type: ignore[union-attr]
    return backend.options._timeout


def gloo_group() -> Any:
    """A new gloo group of every rank (a collective: every rank, at the same point) that waits as long as
    the default group (torch would give it 30 minutes whatever ``dist.timeout_s`` says)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=default_timeout())
