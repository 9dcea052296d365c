"""``dist.strategy=fsdp``: FSDP2 training through torchrun, exact resume from sharded checkpoints, resume at
another world size, and tasks that know nothing of FSDP. Real processes, real signals, real files.

The launch helpers (``start``, ``run_to_end``, the ``launches`` fixture) are tests/test_resume.py's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import helpers
import pytest
import test_resume
import torch
from tasks_helpers import LINE_RUN, addition_tiny, write_line_task
from test_resume import Launch, assert_resumed_from, run_to_end, start

from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train import checkpoint, fsdp, loader
from ddp_slurm.train.checkpoint import sharded as ckpt_sharded
from ddp_slurm.train.step import Padding
from ddp_slurm.train.task import Tensors

FSDP = [
    "dist.strategy=fsdp",
    "model.name=mlp",
    "train.global_batch_size=64",
    "train.epochs=1",
    "train.max_steps=40",
    "train.log_every_steps=2",
    "checkpoint.every_steps=10",
    "checkpoint.keep=100",
    "run.name=r",
]
EXIT_STOPPED = 75


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    """test_resume's fixture: the launches of a test, any still running killed at its end."""
    yield from test_resume.launches.__wrapped__()


def committed(run_dir: Path) -> list[int]:
    return [step for step, _ in ckpt_sharded.list_sharded(RunPaths(run_dir))]


def assert_same_state(run_dir: Path, reference: Path) -> None:
    got, want = checkpoint.load_latest(run_dir), checkpoint.load_latest(reference)
    assert got is not None and want is not None and got["finished"] and got["step"] == want["step"]
    different = [k for k, t in want["model"].items() if not torch.equal(t, got["model"][k])]
    assert not different, f"weights differ from the uninterrupted run: {different}"
    a, b = dict(checkpoint._tensors(got["optimizer"])), dict(checkpoint._tensors(want["optimizer"]))
    assert a.keys() == b.keys() and all(torch.equal(t, b[k]) for k, t in a.items())


def assert_stop_and_resume_bit_identical(
    launches: list[Launch], cwd: Path, world_size: int, args: list[str], after_step: int
) -> int:
    """The run left alone (in ``cwd/ref``, which may hold the task's file), then the same run stopped by
    SIGUSR2 to its last rank once it has trained ``after_step`` steps (every rank exits 75 with a checkpoint
    of the stop step) and launched again to the end: both end with the same weights, buffers and optimizer
    state (torch.equal). Any strategy; returns the stop step."""
    (cwd / "ref").mkdir(exist_ok=True)
    reference = run_to_end(launches, cwd / "ref", world_size, args)
    first = start(launches, cwd, world_size, args)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row(
        f"training to pass step {after_step}", lambda r: r["kind"] == "train" and r["step"] >= after_step
    )
    first.signal(world_size - 1, signal.SIGUSR2)
    stop = test_resume.assert_stopped(first)["step"]
    second = run_to_end(launches, cwd, world_size, args)
    assert_resumed_from(second, stop)
    assert_same_state(first.run_dir, reference.run_dir)
    return stop


def assert_stopped(launch: Launch) -> int:
    """Every rank exited 75 after the sharded checkpoint of the stop step was committed; the stop step."""
    code, text = launch.finish()
    codes = re.findall(r"^\s+exitcode\s*:\s*(-?\d+)", text, re.M)  # torchrun's summary of its workers
    assert code != 0 and codes == [str(EXIT_STOPPED)] * launch.world_size, text[-3000:]
    stops = [r for r in launch.rows() if r["kind"] == "stop"]
    assert len(stops) == 1, text[-3000:]
    step = stops[0]["step"]
    assert f"stopped on signal at step {step} with a checkpoint" in text
    assert committed(launch.run_dir)[0] == step
    assert not [p for p in (launch.run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    return step


def test_sigusr2_resume_is_bit_identical_and_reshards_at_another_world_size(
    launches: list[Launch], tmp_path: Path
) -> None:
    """Two ranks under fsdp, SIGUSR2 to rank 1 mid-epoch: both stop at one step with a committed sharded
    checkpoint; the relaunch ends bit-identical (weights and optimizer state) to the run left alone. A
    copy of the stopped run resumes at one rank (DCP reshards) and finishes."""
    (tmp_path / "ref").mkdir()
    reference = run_to_end(launches, tmp_path / "ref", 2, FSDP)
    folder = reference.run_dir / "checkpoints" / "step-40"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "commit.pt", "seal-0.json", "seal-1.json"]
    assert [r["accuracy"] for r in reference.rows() if r["kind"] == "eval"][0] > 0.7

    first = start(launches, tmp_path, 2, FSDP)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row("training to pass step 10", lambda r: r["kind"] == "train" and r["step"] >= 10)
    first.signal(1, signal.SIGUSR2)
    stop = assert_stopped(first)
    assert 10 <= stop < 40
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "runs", other / "runs")

    second = run_to_end(launches, tmp_path, 2, FSDP)
    assert_resumed_from(second, stop)
    assert_same_state(first.run_dir, reference.run_dir)

    third = run_to_end(launches, other, 1, FSDP)
    assert_resumed_from(third, stop)
    assert "from a sharded checkpoint of world size 2" in third.log_text()
    final = checkpoint.load_latest(third.run_dir)
    assert final is not None and final["finished"] and final["step"] == 40 and final["world_size"] == 1


def test_strategy_is_kept_across_relaunches(launches: list[Launch], tmp_path: Path) -> None:
    """A run started under fsdp refuses to resume under ddp (one line, exit 2, its checkpoints untouched)."""
    run = run_to_end(launches, tmp_path, 1, [*FSDP, "train.max_steps=10"])
    before = sorted(p.name for p in (run.run_dir / "checkpoints").iterdir())
    again = start(launches, tmp_path, 1, [*FSDP, "train.max_steps=10", "dist.strategy=ddp"])
    code, text = again.finish()
    assert code == 2, text
    assert "holds dist.strategy=fsdp checkpoints" in text and "launch with dist.strategy=fsdp" in text
    assert sorted(p.name for p in (run.run_dir / "checkpoints").iterdir()) == before


@pytest.mark.parametrize("example", ["line", "addition"])
def test_tasks_train_under_fsdp_unchanged(launches: list[Launch], tmp_path: Path, example: str) -> None:
    """A task defined only in a test file (docs/tasks.md's Line: one nn.Linear, nothing FSDP-specific) and
    the addition example (a transformer, the Dataset path with workers) train under fsdp at 2 ranks; the
    Line run also accumulates 2 micro-batches per step (FSDP's set_requires_gradient_sync) and clips."""
    if example == "line":
        write_line_task(tmp_path)
        args = ["task=line_task.py:Line", *LINE_RUN, "run.name=r", "dist.strategy=fsdp"]
        args += ["train.accumulate=2", "train.grad_clip=10.0"]
    else:
        args = [*addition_tiny(epochs=1, train_size=1024), "run.name=r", "dist.strategy=fsdp"]
    run = run_to_end(launches, tmp_path, 2, args)
    assert [r for r in run.rows() if r["kind"] == "eval"], run.log_text()[-3000:]
    assert committed(run.run_dir), run.log_text()[-3000:]
    norms = [r.get("grad_norm") for r in run.rows() if r["kind"] == "train"]
    assert all(n is not None and n > 0 for n in norms) if example == "line" else not any(norms)


def test_padded_evaluation_runs_as_many_batches_on_every_rank() -> None:
    """Every forward of a sharded model is a collective: a rank with fewer eval batches pads with batches
    that count for nothing, up to the count of the rank with the most; a rank with none borrows one."""
    data = Tensors(torch.arange(10.0))
    cpu = torch.device("cpu")
    counts = []
    for rank in range(3):  # shards of 3, 3, 4 samples in batches of 2: 2, 2, 2 batches
        out = list(fsdp.padded(loader.eval_batches(data, cpu, rank, 3, 2, 0), data, cpu, rank, 3, 2))
        counts.append((sum(not isinstance(b, Padding) for b in out), len(out)))
    assert counts == [(2, 2), (2, 2), (2, 2)]
    counts = []
    for rank in range(3):  # batches of 3: 1, 1, 2 batches
        out = list(fsdp.padded(loader.eval_batches(data, cpu, rank, 3, 3, 0), data, cpu, rank, 3, 3))
        counts.append((sum(not isinstance(b, Padding) for b in out), len(out)))
    assert counts == [(1, 2), (1, 2), (2, 2)]
    tiny = Tensors(torch.arange(2.0))  # 4 ranks, 2 samples: ranks 0 and 2 have nothing of their own
    out = list(fsdp.padded(loader.eval_batches(tiny, cpu, 0, 4, 8, 0), tiny, cpu, 0, 4, 8))
    assert len(out) == 1 and isinstance(out[0], Padding) and torch.equal(out[0].batch[0], torch.arange(2.0))


def test_kill9_during_a_sharded_write_leaves_the_previous_checkpoint(launches: list[Launch], tmp_path: Path) -> None:
    """SIGKILL to every process while a sharded write is in flight (its ``.step-N.partial`` folder exists):
    the newest committed checkpoint is the one resumed from, the partial write is never counted and is
    cleared by the relaunch, which finishes."""
    args = [*FSDP, "checkpoint.every_steps=1", "checkpoint.keep=3"]
    folder = tmp_path / "runs" / "r" / "checkpoints"
    for _attempt in range(5):  # the write may commit between seeing its folder and the kill: try again
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)
        launch = start(launches, tmp_path, 2, args)
        launch.wait_for("a first committed checkpoint", lambda: bool(committed(launch.run_dir)), poll_s=0.001)
        partial: list[Path] = []

        def writing() -> bool:
            partial[:] = list(folder.glob(RunPaths(tmp_path).partial("*").name))
            return bool(partial)

        workers = [launch.worker(rank) for rank in range(2)]  # torchrun starts each in a session of its own
        launch.wait_for("a sharded write in flight", writing, poll_s=0.0005)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        os.killpg(launch.proc.pid, signal.SIGKILL)
        launch.proc.wait()
        while any(Path(f"/proc/{pid}").exists() and test_resume.state_of(pid) != "Z" for pid in workers):
            time.sleep(0.01)
        if any(p.exists() for p in partial):
            break
    else:
        pytest.fail("never caught a sharded write in flight in 5 attempts")
    in_flight = int(partial[0].name.split("-")[1].split(".")[0])
    newest = committed(launch.run_dir)[0]
    assert newest < in_flight
    found = checkpoint.latest(launch.run_dir)
    assert found is not None and found[1]["step"] == newest

    again = run_to_end(launches, tmp_path, 2, args)
    assert_resumed_from(again, newest)
    assert not list(folder.glob(".*"))


RESNET_TASK = '''
import torch
import torch.nn.functional as F
import torchvision

from ddp_slurm import Task, Tensors


class ResNet(Task):
    """torchvision's resnet18 (batch norm throughout) on random 32x32 images; one FSDP unit per stage."""

    best_metric = "accuracy"

    def build_model(self):
        return torchvision.models.resnet18(num_classes=10)

    def shard_units(self, model):
        return [model.layer1, model.layer2, model.layer3, model.layer4]

    def images(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)

    def train_data(self):
        return Tensors(*self.images(256, 0))

    def training_step(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def eval_data(self):
        return Tensors(*self.images(32, 1))

    def eval_step(self, model, batch):
        x, y = batch
        return {"accuracy": (model(x).argmax(1) == y).float()}
'''


def test_batch_norm_statistics_resume_exactly_under_fsdp(launches: list[Launch], tmp_path: Path) -> None:
    """A model nobody here wrote (torchvision's resnet18, 20 batch-norm layers) at 2 ranks under fsdp,
    SIGUSR2 mid-run and a relaunch: the weights, the optimizer state and every batch-norm running statistic
    end bit-identical to the run left alone. Each rank's statistics evolve on its own batches; rank 0's are
    the model's, as under ddp (every rank takes them before a save and an evaluation)."""
    (tmp_path / "ref").mkdir()
    args = ["task=resnet_task.py:ResNet", "dist.strategy=fsdp", "train.global_batch_size=16", "train.epochs=1"]
    args += ["train.log_every_steps=1", "checkpoint.every_steps=4", "checkpoint.keep=100", "run.name=r"]
    for where in (tmp_path, tmp_path / "ref"):
        (where / "resnet_task.py").write_text(RESNET_TASK)
    stop = assert_stop_and_resume_bit_identical(launches, tmp_path, 2, args, after_step=5)
    assert 5 <= stop < 16
    final = checkpoint.load_latest(tmp_path / "ref" / "runs" / "r")
    assert final is not None and final["step"] == 16
    assert sum(k.endswith("running_mean") for k in final["model"]) == 20


BF16_NORMS = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from ddp_slurm.train import fsdp
    from ddp_slurm.train.step import autocast

    rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    head = nn.Linear(4 * 8 * 8, 2)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), block, nn.Flatten(), head, nn.BatchNorm1d(2))
    norms = [model[1], block[1], model[5]]  # a unit itself, inside a unit, left to the root
    cpu = torch.device("cpu")
    fsdp.shard(model, [model[1], block, head], cpu, "bf16")
    seen = {}

    def weight_dtype(name):  # the dtype each layer computes with: its gathered weight, seen as its forward starts
        def hook(module, args):
            seen.setdefault(name, str(module.weight.dtype))
        return hook

    for name, module in (("unit", model[1]), ("inner", block[1]), ("root", model[5]), ("head", head)):
        module.register_forward_pre_hook(weight_dtype(name))
    for _ in range(2):
        with autocast(cpu, "bf16"):
            y = model(torch.randn(8, 1, 8, 8))
        y.float().square().mean().backward()
    buffers = sorted({str(b.dtype) for m in norms for b in m.buffers() if b.is_floating_point()})
    grads = sorted({str(p.grad.dtype) for p in model.parameters()})
    own = [fsdp.is_sharded(m) for m in norms]
    with open(out, "w") as f:
        json.dump({"seen": seen, "buffers": buffers, "grads": grads, "own": own}, f)
    dist.destroy_process_group()
""")


def test_bf16_shards_every_batch_norm_on_its_own_in_fp32(tmp_path: Path) -> None:
    """train.precision=bf16 under fsdp, a model with batch norm as a unit, inside a unit and left to the root
    (2 ranks): each batch norm is sharded on its own and computes with fp32 weights beside its fp32
    statistics, while the other layers gather bf16 weights; forward and backward run. Under one bf16
    policy for all (the old code) the first batch norm raises "expected scalar type BFloat16 but found Float"."""
    script = tmp_path / "norms.py"
    script.write_text(BF16_NORMS)
    r0, r1 = helpers.two_ranks(script, tmp_path)
    assert r0 == r1
    want = {"unit": "torch.float32", "inner": "torch.float32", "root": "torch.float32", "head": "torch.bfloat16"}
    assert r0["seen"] == want
    assert r0["buffers"] == ["torch.float32"] and r0["grads"] == ["torch.float32"] and r0["own"] == [True] * 3
