"""distributed/groups.py at the tensor level: an evaluation traced with tensors that claim the ``cuda`` device.

No GPU runs here, and on CPU the host and training groups carry the same tensors. torch's ``FakeTensorMode``
makes tensors that claim ``cuda`` and hold no data (a cuda/cpu mix still raises "Expected all tensors to be
on the same device"), so an evaluation traced with them meets the groups as it would on a GPU cluster. The
default group is made as NCCL's is (``cuda:gloo``: CUDA tensors only) and ``Groups.make`` names the roles as
it does there (the training group is the default, the host group a gloo group made beside it). ``Roles``
stands in for what NCCL and the GPU would say: it refuses a host tensor on the training group and a device
tensor on the host group, and counts the values read back on the host (a device tensor read is a wait for
the device). One rank: every collective's result is its input, which is how the host flags keep their
values through the trace (the fake tensors have none of their own).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ddp_slurm.distributed import groups as groups_mod
from ddp_slurm.distributed.groups import Groups
from ddp_slurm.train import step
from ddp_slurm.train.evaluation import EvalVote
from ddp_slurm.train.signals import StopFlag

CARRIES = {"host": "cpu", "train": "cuda"}


class Roles(TorchDispatchMode):
    """Each collective's tensors against its group's role; the host's reads of tensor values.

    ``values``: what the host tensors made from Python numbers hold (the one kind of value the trace reads
    back: the stop flags), followed through ``unbind`` (``tolist``) and the collectives (one rank)."""

    def __init__(self, made: Groups) -> None:
        super().__init__()
        world = dist.group.WORLD
        self.role = {(made.host or world).group_name: "host", (made.train or world).group_name: "train"}
        self.collectives: list[tuple[str, str, str]] = []  # (op, role, device)
        self.reads: list[str] = []  # the device of each value read on the host
        self.copies: list[str] = []  # each copy between host and device ("cpu->cuda")
        self.values: dict[int, tuple[torch.Tensor, Any]] = {}  # id(fake) -> (fake, kept alive; its value)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self.collective(func, args)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(args[0].device.type)
            known = self.values.get(id(args[0]))
            return known[1] if known is not None else 0  # a device value: no data, zero
        out = func(*args, **kwargs)
        if func is torch.ops.aten.lift_fresh.default and not isinstance(args[0], type(out)):
            with _disable_current_modes():  # the real tensor torch.tensor(numbers) made: a host value
                self.values[id(out)] = (out, args[0].tolist())
        elif func is torch.ops.aten._to_copy.default and out.device.type != args[0].device.type:
            self.copies.append(f"{args[0].device.type}->{out.device.type}")
            if id(args[0]) in self.values:
                self.values[id(out)] = (out, self.values[id(args[0])][1])
        elif func is torch.ops.aten.unbind.int and id(args[0]) in self.values and out[0].dim() == 0:
            for fake, value in zip(out, self.values[id(args[0])][1]):
                self.values[id(fake)] = (fake, value)
        return out

    def collective(self, func: Any, args: Any) -> None:
        leaves = pytree.tree_leaves(args)
        boxed = [a for a in leaves if isinstance(a, torch.ScriptObject)]
        pgs = [dist.ProcessGroup.unbox(a) for a in boxed if a._type().qualified_name().endswith(".ProcessGroup")]
        role = self.role[pgs[0].group_name]
        for tensor in (a for a in leaves if isinstance(a, torch.Tensor)):
            if tensor.device.type != CARRIES[role]:
                raise RuntimeError(f"{func}: a {tensor.device.type} tensor on the {role} group")
            self.collectives.append((func.__name__.split(".")[0], role, tensor.device.type))


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Iterator[Groups]:
    """A one-rank default group shaped like NCCL's, and the groups the runtime names on a GPU."""
    # dist.broadcast asks a CUDA tensor's device for its compute capability (fp8 on sm90): no device here
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    dist.init_process_group(groups_mod.default_backend("gloo", {groups_mod.NCCL_SHAPED: "1"}), store=dist.HashStore(), rank=0, world_size=1)  # fmt: skip
    try:
        yield Groups.make(torch.device("cuda"))
    finally:
        dist.destroy_process_group()


def model() -> nn.Module:
    """Batch norm (float and integer buffers) on claimed-CUDA tensors."""
    with torch.device("cuda"):  # made there (a fake tensor cannot be swapped for another by .to)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def metrics_of(net: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"accuracy": (net(x).argmax(1) == y).float()}


def traced(made: Groups, batches: int) -> tuple[Roles, Any]:
    """One evaluation of ``batches`` batches at a claimed world size of 2 (one rank runs: see the module)."""
    with FakeTensorMode():
        net = model()
        data = [(torch.randn(5, 1, 8, 8, device="cuda"), torch.zeros(5, dtype=torch.long, device="cuda"))] * batches
        with Roles(made) as roles:
            found = step.evaluate(
                net,
                data,
                metrics_of,
                torch.device("cuda"),
                2,
                "fp32",
                groups=made,
                vote=EvalVote(StopFlag(), 2, made.host),
            )
    return roles, found


@pytest.mark.parametrize("batches", [1, 3])
def test_an_evaluation_sends_host_values_on_the_host_group_and_waits_for_the_device_once(
    made: Groups, batches: int
) -> None:
    """The buffers (one broadcast per dtype) and the totals on the training group as device tensors; the
    stop flags (one vote a batch, and the one that ends) and the names on the host group as host tensors; and
    whatever the number of batches, one read of a device value: the totals at the end."""
    assert made.train is None and made.host is not None  # NCCL's shape: the default group trains
    roles, found = traced(made, batches)
    assert roles.copies == []  # nothing goes from the host to the device (or back) but the totals' read
    votes = [("allreduce_", "host", "cpu")] * (batches + 1)
    buffers = [("broadcast_", "train", "cuda")] * 2  # float32 statistics, int64 counts
    names = [("broadcast_", "host", "cpu")] * 2  # broadcast_object_list: the sizes, then the bytes
    assert roles.collectives == buffers + votes + names + [("allreduce_", "train", "cuda")]
    assert roles.reads.count("cuda") == 2  # totals.tolist(): [samples, accuracy]
    assert found == ({"accuracy": 0.0}, 0)  # the device's totals read as zeros: fake tensors hold no data


@pytest.mark.parametrize("swap", ["flags on the training group", "everything on the other group"])
def test_a_value_on_the_other_roles_group_fails(made: Groups, swap: str) -> None:
    wrong = (
        Groups(train=made.train, host=made.train)
        if swap == "flags on the training group"
        else Groups(train=made.host, host=made.train)
    )
    side = "cpu tensor on the train" if swap == "flags on the training group" else "cuda tensor on the host"
    with pytest.raises(RuntimeError, match=side):
        traced(wrong, 2)
