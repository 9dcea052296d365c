"""train.cuda_graphs (train/graphs.py): what runs without a GPU.

The capture and replay themselves need CUDA: tests/test_gpu_path.py runs them (marked ``gpu``, run by
benchmarks/gpu_check.sh). Here: the refusals made before anything starts (CPU: exit 2 in one line,
nothing created, also in tests/bad_inputs.py; several ranks), the input buffers that every batch is
copied into and their refusal of a batch of another shape, the refusal of an optimizer that cannot be
captured, and the translation of a capture error into one line naming the task's line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import base_env

from ddp_slurm import config
from ddp_slurm.config import ConfigError
from ddp_slurm.tasks.mnist import models
from ddp_slurm.train import graphs, strategy
from ddp_slurm.train.optim import make_optimizer
from ddp_slurm.train.strategy import DDP


def test_on_cpu_the_run_is_refused_in_one_line_and_nothing_is_created(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.train", "train.cuda_graphs=true", "model.name=mlp"],
        cwd=tmp_path,
        env=base_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.cuda_graphs=true needs a CUDA GPU" in lines[0], res.stderr
    assert "train.cuda_graphs=false" in lines[0] and res.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_several_ranks_and_no_gpu_are_refused_before_anything_starts() -> None:
    cfg = config.load(overrides=["train.cuda_graphs=true"])
    with pytest.raises(ConfigError, match="world size 1.*not 2"):
        graphs.check(cfg, DDP(), 2, cuda=True)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        graphs.check(cfg, DDP(), 1, cuda=False)
    graphs.check(cfg, DDP(), 1, cuda=True)
    graphs.check(config.load(), DDP(), 4, cuda=False)  # off: nothing to refuse


@pytest.mark.parametrize(
    "override",
    ["dist.strategy=fsdp", "train.accumulate=2", "train.grad_clip=1.0", "train.activation_checkpoint=true"],
    ids=["fsdp", "accumulate", "clip", "activation_checkpoint"],
)
def test_what_the_captured_step_does_not_do_is_refused_on_any_machine(override: str) -> None:
    cfg = config.load(overrides=["train.cuda_graphs=true", override])
    with pytest.raises(ConfigError, match=r"captures a plain DDP step, not one with " + override.split("=")[0]):
        graphs.check(cfg, strategy.of(cfg.dist.strategy), 1, cuda=True)


def test_every_batch_is_copied_into_the_captured_buffers() -> None:
    first = (torch.arange(6, dtype=torch.uint8).reshape(2, 3), {"y": torch.tensor([1, 2])})
    inputs = graphs._Inputs(first, torch.device("cpu"))
    static_x, static_y = inputs.static[0], inputs.static[1]["y"]
    assert static_x.data_ptr() != first[0].data_ptr()  # buffers of its own, filled from each batch
    nxt = (torch.full((2, 3), 7, dtype=torch.uint8), {"y": torch.tensor([5, 6])})
    inputs.fill(nxt)
    assert inputs.static[0] is static_x and torch.equal(static_x, nxt[0]) and static_y.tolist() == [5, 6]


@pytest.mark.parametrize(
    "batch, says",
    [
        ((torch.zeros(3, 3, dtype=torch.uint8), {"y": torch.zeros(2, dtype=torch.int64)}), "([3, 3] uint8"),
        ((torch.zeros(2, 3, dtype=torch.float32), {"y": torch.zeros(2, dtype=torch.int64)}), "[2, 3] float32"),
        ((torch.zeros(2, 3, dtype=torch.uint8),), "([2, 3] uint8)"),
    ],
    ids=["ragged", "dtype", "structure"],
)
def test_a_batch_of_another_shape_stops_with_one_line(batch, says: str) -> None:
    inputs = graphs._Inputs(
        (torch.zeros(2, 3, dtype=torch.uint8), {"y": torch.zeros(2, dtype=torch.int64)}), torch.device("cpu")
    )
    with pytest.raises(graphs.GraphError) as err:
        inputs.fill(batch)
    line = str(err.value)
    assert "\n" not in line and says in line and "([2, 3] uint8, {'y': [2] int64})" in line, line
    assert "train.cuda_graphs=false" in line


def test_a_batch_holding_a_non_tensor_or_a_tensor_elsewhere_is_refused() -> None:
    with pytest.raises(graphs.GraphError, match=r"batch\[1\] is a str"):
        graphs._Inputs((torch.zeros(2), "label"), torch.device("cpu"))
    with pytest.raises(graphs.GraphError, match=r"batch\[0\] is on cpu, not meta"):
        graphs._Inputs((torch.zeros(2),), torch.device("meta"))


def test_an_optimizer_that_cannot_be_captured_is_named() -> None:
    model = models.build("mlp")
    plain = torch.optim.RMSprop(model.parameters())
    with pytest.raises(graphs.GraphError, match="RMSprop"):
        graphs.make_step(model, plain, None, lambda m, b: m(b).sum(), torch.device("cpu"))
    runtime = make_optimizer(config.load().train, model.parameters(), torch.device("cpu"))
    assert runtime.defaults.get("fused")  # the runtime's own optimizer is the capturable kind
    graphs.make_step(model, runtime, None, lambda m, b: m(b).sum(), torch.device("cpu"))


def _syncing_training_step(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    loss = model(batch).sum()
    if loss.item() > 0:  # what a capture refuses: the host reads a device value mid-step
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    return loss


def test_a_capture_error_names_the_tasks_line() -> None:
    """The error torch raises inside a capture, with the error the capture's end raises on top of it
    (its context), becomes one line that points at the task's own line and says what to do."""
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    try:
        try:
            _syncing_training_step(model, torch.ones(1, 2))
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture") from None
    except RuntimeError as outer:
        line = graphs.explain(outer, _syncing_training_step)
    assert "\n" not in line
    assert f"{__file__}:" in line and "(raise RuntimeError" in line, line
    assert "operation not permitted when stream is capturing" in line and "train.cuda_graphs=false" in line


def test_a_task_with_state_of_its_own_is_refused_before_anything_starts() -> None:
    """training_step runs only at the warm-up and the capture: a task that keeps state (overrides
    state_dict) is refused in one line on any machine; the bundled task is not."""
    from ddp_slurm.tasks.mnist.task import MNIST

    class WithEMA(MNIST):
        def state_dict(self):
            return {"ema": 0.0}

    cfg = config.load(overrides=["train.cuda_graphs=true"])
    with pytest.raises(ConfigError, match=r"calls WithEMA.training_step only to warm up and capture .* state_dict"):
        graphs.check(cfg, DDP(), 1, cuda=True, task_cls=WithEMA)
    graphs.check(cfg, DDP(), 1, cuda=True, task_cls=MNIST)


def test_a_schedule_of_momentum_is_refused_at_the_first_replay_it_changes() -> None:
    """Only the learning rate is fed to the graph: a scheduler that moves momentum (OneCycleLR's
    cycle_momentum) stops training with one line at the first replay after it does. The graph and
    its inputs are stand-ins (no GPU here); the check runs on the host after the scheduler steps."""
    from types import SimpleNamespace

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    constant = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10, cycle_momentum=False)
    step = graphs.GraphedStep(model, opt, constant, lambda m, b: m(b).sum(), torch.device("cpu"), "fp32")
    step.graph, step.inputs, step.loss = (
        SimpleNamespace(replay=opt.step),
        SimpleNamespace(fill=lambda b: None),
        torch.zeros(()),
    )
    step.lrs = [torch.zeros(())]
    step.fixed = graphs.fixed_hyperparameters(opt.param_groups)
    step(torch.zeros(1, 2))  # the learning rate moves, nothing else: fine
    step.scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10, cycle_momentum=True)
    step.fixed = graphs.fixed_hyperparameters(opt.param_groups)
    with pytest.raises(
        graphs.GraphError, match=r"the schedule changed momentum of parameter group 0 .* only the learning rate"
    ):
        step(torch.zeros(1, 2))
