"""``train.precision=fp16`` (``train/precision.py``, the step in ``train/accumulate.py``, the scaler's state in
``train/checkpoint/state.py``): what runs without a GPU. fp16 autocast and torch's GradScaler run on CPU, so
the step, the skipped steps and the checkpointed scale are tested here on CPU; training with
``train.precision=fp16`` itself is refused on CPU (slower than fp32 there) and under fsdp."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import helpers
import pytest
import torch
from torch import nn

from ddp_slurm import config
from ddp_slurm.config import ConfigError
from ddp_slurm.train import checkpoint, graphs, strategy
from ddp_slurm.train.accumulate import NormWindow
from ddp_slurm.train.checkpoint.backends import WholeFile
from ddp_slurm.train.optim import make_optimizer, make_scheduler
from ddp_slurm.train.precision import check_precision, make_scaler
from ddp_slurm.train.signals import StopFlag
from ddp_slurm.train.step import make_step
from ddp_slurm.train.vote import StopVote

CPU = torch.device("cpu")


def test_fp16_is_refused_on_cpu_and_under_fsdp_in_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        check_precision("fp16", CPU, strategy.of("ddp"))
    assert (
        str(info.value) == "train.precision=fp16 needs a CUDA GPU, and this rank runs on cpu: use train.precision=fp32"
    )
    for device in (CPU, torch.device("cuda", 0)):  # the strategy is asked first: no GPU needed to learn it
        with pytest.raises(ConfigError) as info:
            check_precision("fp16", device, strategy.of("fsdp"))
        message = str(info.value)
        assert "\n" not in message and message.startswith("train.precision=fp16 runs under dist.strategy=ddp, not fsdp")
        assert message.endswith("use train.precision=bf16")
    check_precision("fp16", torch.device("cuda", 0), strategy.of("ddp"))  # any CUDA GPU: fp16 needs no capability


def test_the_captured_step_refuses_fp16() -> None:
    cfg = config.load(overrides=["train.cuda_graphs=true", "train.precision=fp16"])
    with pytest.raises(ConfigError, match=r"captures a plain DDP step, not one with train.precision=fp16"):
        graphs.check(cfg, strategy.of("ddp"), 1, cuda=True)


def test_a_scaler_only_for_fp16() -> None:
    assert make_scaler("fp32", CPU) is None and make_scaler("bf16", CPU) is None
    scaler = make_scaler("fp16", CPU)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 2.0**16


def trainer(scaler: torch.amp.GradScaler, clip: float | None = 1.0):
    """A model, optimizer, schedule and the fp16 step on CPU, as ``run.build`` makes them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    cfg = config.Config().train
    optimizer = make_optimizer(cfg, model.parameters(), CPU)
    scheduler = make_scheduler(cfg, optimizer, 100)

    def loss_of(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(m(x).float(), y)

    step = make_step(model, optimizer, scheduler, loss_of, CPU, "fp16", grad_clip=clip, scaler=scaler)
    return model, optimizer, scheduler, step


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(n)]


def big_scaler() -> torch.amp.GradScaler:
    """A scale whose first steps overflow fp16 gradients (skipped), and that grows back every 3 steps."""
    return torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)


def test_an_overflowing_step_is_skipped_not_a_non_finite_loss() -> None:
    """Scaled gradients that overflow fp16: the weights stay, the scale halves, the loss is finite, the stop
    vote flags nothing; the clipping norm is of the unscaled gradients."""
    scaler = big_scaler()
    model, _, _, step = trainer(scaler)
    before = [p.detach().clone() for p in model.parameters()]
    loss = step(batches(1)[0])
    assert math.isfinite(loss.item()) and scaler.get_scale() == 2.0**23
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not math.isfinite(step.grad_norm.item())
    assert StopVote(StopFlag(), 1, CPU).exchange(loss, 1, wait=True) == (False, False, False)
    norms = []
    for _ in range(20):  # the scale comes down to where the gradients fit (growing, overflowing), the model trains
        step(batches(1)[0])
        norms.append(step.grad_norm.item())
    assert scaler.get_scale() < 2.0**23 and not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finite = [n for n in norms if math.isfinite(n)]
    assert len(finite) >= 10 and max(finite) < 100  # unscaled before clipping: not multiplied by the scale


def test_the_norm_window_counts_finite_norms_only() -> None:
    window = NormWindow()
    for norm in (2.0, float("inf"), 4.0):
        window.add(torch.tensor(norm))
    assert window.close() == {"grad_norm": 3.0}
    window.add(torch.tensor(float("inf")))
    assert window.close() == {} and window.close() == {}


def run_objects(model, optimizer, scheduler, scaler) -> SimpleNamespace:
    return helpers.run_objects(model, optimizer, scheduler, scaler=scaler)


def test_the_scale_is_checkpointed_and_a_resumed_run_is_bit_identical(tmp_path: Path) -> None:
    """8 fp16 steps (the first ones skipped, the scale halving then growing) against 4, a real checkpoint
    file with the scaler's state, a fresh run (a default scaler) restored from it, and 4 more."""
    data = batches(8)
    torch.manual_seed(5)
    scaler = big_scaler()
    model, optimizer, _, step = trainer(scaler)
    scales = []
    for batch in data:
        step(batch)
        scales.append(scaler.get_scale())
    assert scales[0] < 2.0**24 and max(scales[1:]) > min(scales)  # skipped, then grown back

    torch.manual_seed(5)
    first_scaler = big_scaler()
    first, opt1, sched1, step1 = trainer(first_scaler)
    for batch in data[:4]:
        step1(batch)
    backend = WholeFile()
    snap = backend.capture(
        run_objects(first, opt1, sched1, first_scaler), False, 1.0, {"config": config.Config().to_dict()}
    )
    assert snap["scaler"] == first_scaler.state_dict()
    path = checkpoint.save(tmp_path, snap, keep=2)
    loaded = backend.read(path)
    rng_after = torch.get_rng_state()

    fresh = make_scaler("fp16", CPU)
    second, opt2, sched2, step2 = trainer(fresh)
    backend.restore(path, loaded, run_objects(second, opt2, sched2, fresh))
    torch.set_rng_state(rng_after)  # the restored streams are the checkpoint's; dropout continues from them
    assert fresh.state_dict() == first_scaler.state_dict()
    for batch in data[4:]:
        step2(batch)
    assert fresh.state_dict() == scaler.state_dict()
    for (name, a), b in zip(model.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    got = checkpoint._tensors(opt2.state_dict())
    want = checkpoint._tensors(optimizer.state_dict())
    assert all(torch.equal(t, w) for (_, t), (_, w) in zip(got, want))


def test_accumulated_micro_batches_are_scaled_each_and_unscaled_once() -> None:
    """``train.accumulate=2`` with fp16: every micro-batch's loss is scaled, the summed gradients unscaled once
    before clipping; the step matches one without accumulation on the same samples (within fp16 rounding)."""
    data = batches(1)[0]
    results = []
    for accumulate in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        cfg = config.Config().train
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = make_scheduler(cfg, optimizer, 100)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

        def loss_of(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return nn.functional.cross_entropy(m(batch[0]).float(), batch[1])

        step = make_step(model, optimizer, scheduler, loss_of, CPU, "fp16", accumulate, 10.0, scaler)
        step(data)
        assert scaler.get_scale() == 2.0**8  # nothing overflowed: nothing skipped
        results.append((step.grad_norm.item(), [p.detach().clone() for p in model.parameters()]))
    (norm1, weights1), (norm2, weights2) = results
    assert norm2 == pytest.approx(norm1, rel=1e-2)
    assert all(torch.allclose(a, b, atol=1e-3) for a, b in zip(weights1, weights2))
