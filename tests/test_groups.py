"""distributed/groups.py: which group carries what, and the NCCL-shaped test mode every multi-rank test of
the suite runs under (a default group with a backend for CUDA tensors only, as NCCL's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import Launcher, base_env

from ddp_slurm.distributed import groups

SCRIPT = """
import logging, os, torch, torch.distributed as dist
logging.basicConfig(level=logging.INFO)
from ddp_slurm.distributed import group
from ddp_slurm.distributed.env import DistEnv
from ddp_slurm.distributed.groups import Groups

env = DistEnv.from_environ(os.environ)
with group.distributed(env, "gloo", timeout_s=60) as (device, backend):
    try:
        dist.all_reduce(torch.ones(1))  # a host tensor on the default group, as on NCCL's
        said = "carried"
    except RuntimeError as exc:
        said = str(exc).splitlines()[0]
    os.write(1, f"default group: {said}\\n".encode())  # one write per line: the two ranks share the pipe
    made = Groups.make(device)
    flag = torch.ones(1)
    dist.all_reduce(flag, group=made.host)
    out = [None]
    dist.broadcast_object_list(out if env.rank else ["hello"], src=0, group=made.host)
    dist.all_reduce(flag, group=made.train)
    waits = sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in (made.train, made.host) if g is not None})
    line = f"rank {env.rank}: host {flag.item()}, train group {made.train is not None}, same {made.train is made.host}, waits {waits}"
    os.write(1, f"{line}\\n".encode())

    from ddp_slurm.train.step import take_rank0_buffers
    norm = torch.nn.BatchNorm1d(3)
    norm.running_mean.fill_(env.rank)
    norm.num_batches_tracked.fill_(10 + env.rank)
    sent, broadcast = [], dist.broadcast
    dist.broadcast = lambda tensor, *a, **k: (sent.append(str(tensor.dtype)), broadcast(tensor, *a, **k))[1]
    take_rank0_buffers(norm, env.world_size, made.train)
    line = f"rank {env.rank}: buffers {norm.running_mean.tolist()} {norm.num_batches_tracked.item()} in {sent}"
    os.write(1, f"{line}\\n".encode())
"""


def test_the_mode_is_read_strictly() -> None:
    assert groups.nccl_shaped({}) is False
    assert groups.nccl_shaped({groups.NCCL_SHAPED: "0"}) is False
    assert groups.nccl_shaped({groups.NCCL_SHAPED: "1"}) is True
    with pytest.raises(groups.GroupsError, match=r"DDP_SLURM_NCCL_SHAPED='yes' is not one of 0, 1"):
        groups.nccl_shaped({groups.NCCL_SHAPED: "yes"})
    assert groups.default_backend("gloo", {groups.NCCL_SHAPED: "1"}) == "cuda:gloo"
    assert groups.default_backend("nccl", {groups.NCCL_SHAPED: "1"}) == "nccl"  # a real GPU run is untouched
    assert groups.default_backend("gloo", {}) == "gloo"


def test_every_child_process_of_the_suite_runs_under_the_mode() -> None:
    assert base_env()[groups.NCCL_SHAPED] == "1"


@pytest.mark.parametrize("shaped", ["1", "0"])
def test_a_host_tensor_on_the_default_group_fails_as_on_nccl(tmp_path: Path, shaped: str) -> None:
    """Under the mode a CPU all-reduce on the default group fails as NCCL's does ("No backend type
    associated with device type cpu"), and the groups the runtime names carry host tensors and objects;
    without it nothing is made (gloo's default group carries everything). Under the mode the training and
    host groups are two groups, each waiting the run's timeout (torch's default would be 30 minutes). Rank 0's
    batch-norm buffers reach rank 1 in one broadcast per dtype."""
    (tmp_path / "script.py").write_text(SCRIPT)
    launcher = Launcher(tmp_path)
    res = launcher.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "script.py"],
        env=base_env(**{groups.NCCL_SHAPED: shaped}),
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 1: buffers [0.0, 0.0, 0.0] 10 in ['torch.float32', 'torch.int64']" in res.stdout
    if shaped == "1":
        assert res.stdout.count("default group: No backend type associated with device type cpu") == 2, res.stdout
        assert "rank 1: host 4.0, train group True, same False, waits [60.0]" in res.stdout  # dist.timeout_s
        assert "(cuda:gloo, the NCCL-shaped test mode)" in res.stderr
    else:
        assert res.stdout.count("default group: carried") == 2, res.stdout
        assert "rank 1: host 4.0, train group False, same True, waits []" in res.stdout


def test_a_bad_value_stops_a_launch_before_anything_is_made(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    res = launcher.run(launcher.cmd_train("model.name=mlp"), env=base_env(**{groups.NCCL_SHAPED: "2"}), timeout=120)
    assert res.returncode == 2, res.stderr
    assert "DDP_SLURM_NCCL_SHAPED='2' is not one of 0, 1" in res.stderr
    assert not (tmp_path / "runs").exists()
