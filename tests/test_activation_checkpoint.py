"""``train.activation_checkpoint`` (``train/activation.py``, applied by ``train/strategy.py``): the task's
units recompute their forward in backward, with gradients, dropout and resume bit-identical to a run
without it, under ddp and fsdp."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_fsdp
import test_resume
import torch
from tasks_helpers import addition_tiny
from test_resume import Launch, assert_resumed_from, run_to_end, start
from torch import nn

from ddp_slurm.train import strategy
from ddp_slurm.train.task import Task


class Blocks(nn.Module):
    """Two blocks with dropout (the units) and a head; its forward draws from the RNG in every block."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 16))
        self.b = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x) + x))


def gradients(name: str, on: bool) -> tuple[dict[str, torch.Tensor], list[str], torch.Tensor]:
    """One forward and backward of ``Blocks`` wrapped by strategy ``name`` (world size 1), seed fixed: the
    gradients by parameter name, the state-dict keys, and the RNG state after backward."""
    torch.manual_seed(0)
    model = Blocks()
    keys = list(model.state_dict())
    net = strategy.of(name).wrap(model, Task(None, None), torch.device("cpu"), "fp32", 1, activation_checkpoint=on)
    x = torch.randn(8, 16)
    for _ in range(2):  # two steps: the second forward's dropout masks come after the first backward's
        net(x).logsumexp(1).sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[n] = g.clone()
    assert list(model.state_dict()) == keys
    return grads, keys, torch.get_rng_state()


def test_gradients_are_bit_identical_with_and_without_it_under_ddp() -> None:
    off, keys, rng_off = gradients("ddp", False)
    on, keys_on, rng_on = gradients("ddp", True)
    assert keys_on == keys  # no wrapper module: checkpoints keep their keys
    assert off.keys() == on.keys() and all(torch.equal(off[k], on[k]) for k in off)
    assert torch.equal(rng_off, rng_on)  # the recomputation leaves the streams where they would be


def test_it_recomputes_each_unit() -> None:
    """Dropout's mask is drawn twice per unit with it on (forward, recomputation), once without."""
    calls = []
    for on in (False, True):
        torch.manual_seed(0)
        model = Blocks()
        seen = []
        for unit in (model.a, model.b):
            unit[2].register_forward_hook(lambda *_: seen.append(1))
        net = strategy.of("ddp").wrap(model, Task(None, None), torch.device("cpu"), "fp32", 1, activation_checkpoint=on)
        net(torch.randn(4, 16)).sum().backward()
        calls.append(len(seen))
    assert calls == [2, 4]


FSDP_SCRIPT = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from test_activation_checkpoint import gradients
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
off, keys, rng_off = gradients("fsdp", False)
on, _, rng_on = gradients("fsdp", True)
assert off.keys() == on.keys() and all(torch.equal(off[k], on[k]) for k in off), "gradients differ"
assert torch.equal(rng_off, rng_on), "RNG differs"
print("same")
"""


def test_gradients_are_bit_identical_with_and_without_it_under_fsdp(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", FSDP_SCRIPT, str(tmp_path / "store"), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and res.stdout.strip() == "same", res.stderr[-3000:]


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    """test_resume's fixture: the launches of a test, any still running killed at its end."""
    yield from test_resume.launches.__wrapped__()


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_two_ranks_stop_and_resume_bit_identical_to_a_run_without_it(
    launches: list[Launch], tmp_path: Path, name: str
) -> None:
    """The addition example (dropout on, the operand swap) at 2 ranks with activation checkpointing, stopped
    by SIGUSR2 mid-run and relaunched, ends bit-identical to the same run without it left alone."""
    import signal

    # 64 steps: a loaded machine must not finish the run before the signal sent at step 10 lands.
    args = [*addition_tiny(epochs=1, train_size=2048, global_batch=32), "run.name=r", f"dist.strategy={name}"]
    (tmp_path / "ref").mkdir()
    reference = run_to_end(launches, tmp_path / "ref", 2, args)
    on = [*args, "train.activation_checkpoint=true"]
    first = start(launches, tmp_path, 2, on)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row("training to pass step 10", lambda r: r["kind"] == "train" and r["step"] >= 10)
    first.signal(1, signal.SIGUSR2)
    code, text = first.finish()
    assert code != 0 and "stopped on signal at step" in text, text[-3000:]
    stop = [r for r in first.rows() if r["kind"] == "stop"][0]["step"]
    assert 10 <= stop < 64
    second = run_to_end(launches, tmp_path, 2, on)
    assert_resumed_from(second, stop)
    test_fsdp.assert_same_state(first.run_dir, reference.run_dir)


def test_it_is_a_typed_config_key_off_by_default() -> None:
    from ddp_slurm import config

    assert config.load().train.activation_checkpoint is False
    assert config.load(overrides=["train.activation_checkpoint=true"]).train.activation_checkpoint is True
    with pytest.raises(config.ConfigError, match="train.activation_checkpoint"):
        config.load(overrides=["train.activation_checkpoint=3"])
    off, on = config.load(), config.load(overrides=["train.activation_checkpoint=true"])
    assert config.incompatible_changes(off, on) == []  # the same result: a relaunch may turn it on
