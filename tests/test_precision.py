"""``train.precision`` (``train/precision.py``, the step in ``train/accumulate.py``, the scaler's state in
``train/checkpoint/state.py``, the bf16 policy in ``train/fsdp.py``). bf16 and fp16 train on CPU under torch's
CPU autocast (with one warning: for testing the GPU path), so the step, the skipped steps, the checkpointed
scale and the bf16 FSDP2 path a GPU cluster runs are tested here; fp16 stays refused under fsdp. Whole runs:
bf16 under ddp and fsdp and fp16 under ddp, with the batch-norm cnn, stopped by SIGUSR2 and relaunched, end
bit-identical to the run left alone."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import helpers
import pytest
import test_guard
import test_resume
import torch
from conftest import Launcher, base_env
from guard_helpers import GUARDED, same_weights, write_poison_task
from tasks_helpers import LINE_RUN, write_line_task
from test_fsdp import assert_stop_and_resume_bit_identical
from test_resume import Launch
from torch import nn

import ddp_slurm
from ddp_slurm import config
from ddp_slurm.config import ConfigError
from ddp_slurm.errors import UsageError
from ddp_slurm.train import checkpoint, graphs, metrics, strategy
from ddp_slurm.train.accumulate import NormWindow
from ddp_slurm.train.checkpoint.backends import WholeFile
from ddp_slurm.train.optim import make_optimizer, make_scheduler
from ddp_slurm.train.precision import check_precision, make_scaler
from ddp_slurm.train.signals import StopFlag
from ddp_slurm.train.step import make_step
from ddp_slurm.train.vote import StopVote

CPU = torch.device("cpu")


def test_mixed_precision_runs_on_cpu_with_a_warning_and_fp16_is_refused_under_fsdp(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for precision in ("bf16", "fp16"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ddp_slurm"):
            check_precision(precision, CPU, strategy.of("ddp"))
        [line] = caplog.messages
        assert line.startswith(f"train.precision={precision} on CPU: torch's CPU autocast, for testing the GPU path")
    check_precision("bf16", CPU, strategy.of("fsdp"))
    for device in (CPU, torch.device("cuda", 0)):  # the strategy is asked first: no GPU needed to learn it
        with pytest.raises(ConfigError) as info:
            check_precision("fp16", device, strategy.of("fsdp"))
        message = str(info.value)
        assert "\n" not in message and message.startswith("train.precision=fp16 runs under dist.strategy=ddp, not fsdp")
        assert message.endswith("use train.precision=bf16")
    check_precision("fp16", torch.device("cuda", 0), strategy.of("ddp"))  # any CUDA GPU: fp16 needs no capability
    with pytest.raises(
        ConfigError, match=r"^train.precision=bf16 runs on a CUDA GPU or the CPU, and this rank runs on meta"
    ):
        check_precision("bf16", torch.device("meta"))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_step_runs_its_forward_under_cpu_autocast(precision: str) -> None:
    """The task's forward inside the step computes in the chosen dtype on CPU; the weights stay fp32."""
    seen: list[torch.dtype] = []
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = m(batch[0])
        seen.append(out.dtype)
        return nn.functional.cross_entropy(out.float(), batch[1])

    scheduler = make_scheduler(config.Config().train, optimizer, 10)
    step = make_step(model, optimizer, scheduler, loss_of, CPU, precision, scaler=make_scaler(precision, CPU))
    step(batches(1)[0])
    assert seen == [torch.bfloat16 if precision == "bf16" else torch.float16]
    assert all(p.dtype == torch.float32 for p in model.parameters())


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

        step = make_step(
            model, optimizer, scheduler, loss_of, CPU, "fp16", accumulate=accumulate, grad_clip=10.0, scaler=scaler
        )
        step(data)
        assert scaler.get_scale() == 2.0**8  # nothing overflowed: nothing skipped
        results.append((step.grad_norm.item(), [p.detach().clone() for p in model.parameters()]))
    (norm1, weights1), (norm2, weights2) = results
    assert norm2 == pytest.approx(norm1, rel=1e-2)
    assert all(torch.allclose(a, b, atol=1e-3) for a, b in zip(weights1, weights2))


def test_fp16_with_an_unfused_optimizer_is_refused_under_sync_debug_error() -> None:
    """``GradScaler.step`` reads the inf flag with ``.item()`` unless the optimizer is fused: one host sync per
    step, refused in one line when ``DDP_SLURM_SYNC_DEBUG=error`` (on CPU too: CI meets what a GPU run would)."""
    model = nn.Linear(4, 2)
    fused = make_optimizer(config.Config().train, model.parameters(), CPU)
    unfused = torch.optim.AdamW(model.parameters(), foreach=True)
    error = {"DDP_SLURM_SYNC_DEBUG": "error"}
    assert isinstance(make_scaler("fp16", CPU, fused, error), torch.amp.GradScaler)
    for environ in ({}, {"DDP_SLURM_SYNC_DEBUG": "warn"}):
        assert isinstance(make_scaler("fp16", CPU, unfused, environ), torch.amp.GradScaler)
    assert make_scaler("bf16", CPU, unfused, error) is None
    with pytest.raises(UsageError) as info:
        make_scaler("fp16", CPU, unfused, error)
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        "train.precision=fp16 with an optimizer that is not fused (AdamW)"
    ), message
    assert "DDP_SLURM_SYNC_DEBUG=error refuses: use a fused optimizer" in message


# -- whole runs: 2 CPU ranks, the batch-norm cnn, stopped by SIGUSR2 and relaunched ---------------------------

MIXED = [
    "train.global_batch_size=128",
    "train.epochs=1",
    "checkpoint.every_steps=5",
    "checkpoint.keep=100",
    "run.name=r",
]
MODEL = {  # fp16 convolutions on CPU take seconds a step: the fp16 run trains the mlp, through many more steps
    "bf16": ["model.name=cnn", "train.max_steps=20", "train.log_every_steps=1"],
    "fp16": ["model.name=mlp", "train.max_steps=60", "train.log_every_steps=2"],
}


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    """test_resume's fixture: the launches of a test, any still running killed at its end."""
    yield from test_resume.launches.__wrapped__()


@pytest.mark.parametrize(
    ("precision", "strategy"),
    [("bf16", "ddp"), ("bf16", "fsdp"), ("fp16", "ddp")],
    ids=["bf16-ddp", "bf16-fsdp", "fp16-ddp"],
)
def test_mixed_precision_on_cpu_resumes_bit_identical(
    launches: list[Launch], tmp_path: Path, precision: str, strategy: str
) -> None:
    """What a GPU cluster runs, on 2 CPU ranks: the cnn (batch norm after every convolution) in bf16 under ddp
    and under fsdp (FSDP2's bf16 policy: batch norm sharded on its own in fp32), and the mlp in fp16 under ddp
    (the gradient scaler, its state checkpointed). SIGUSR2 mid-run and a relaunch end with the weights,
    batch-norm statistics, optimizer state and scaler state of the run left alone (torch.equal); the run's
    evaluation runs in the same precision, and the newest checkpoint exports to fp32 weights that load back."""
    args = [*MIXED, *MODEL[precision], f"train.precision={precision}", f"dist.strategy={strategy}"]
    stop = assert_stop_and_resume_bit_identical(launches, tmp_path, 2, args, after_step=4)
    reference = tmp_path / "ref" / "runs" / "r"
    final, want = checkpoint.load_latest(tmp_path / "runs" / "r"), checkpoint.load_latest(reference)
    assert final is not None and want is not None and 4 <= stop < want["step"]
    # fp16: the scale and its count of steps since the last overflow came back from the checkpoint
    assert final["scaler"] == want["scaler"] and (final["scaler"] is not None) == (precision == "fp16")
    log = (tmp_path / "ref" / "launch-0.log").read_text()  # the run left alone: one warning, from rank 0
    assert log.count(f"train.precision={precision} on CPU: torch's CPU autocast") == 1, log[-3000:]
    evals = [r for r in metrics.read(reference / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and evals[-1]["accuracy"] > 0.5, evals
    if strategy == "fsdp":
        res = test_resume.export(tmp_path, tmp_path / "runs" / "r", tmp_path / "export")
        assert res.returncode == 0, res.stderr
        plain = torch.load(tmp_path / "export" / "model.pt", weights_only=True)
        assert all(t.dtype in (torch.float32, torch.int64) for t in plain.values())
        assert all(torch.equal(plain[k], t) for k, t in final["model"].items())
        assert ddp_slurm.load_model(tmp_path / "export") is not None


def test_the_guard_replays_bf16_steps_bit_for_bit_under_fsdp(tmp_path: Path) -> None:
    """bf16 under fsdp with the guard on (2 ranks): a poisoned sample is rolled back and replayed, the replay
    computes the same bits (the verdict "reproduced" needs them), the step is skipped and the sample, tried
    one at a time in bf16, is named and left out of the next epoch; the run ends torch.equal to one told to
    skip that step and that sample from the start."""
    write_poison_task(tmp_path)
    args = [*GUARDED, "train.precision=bf16", "dist.strategy=fsdp"]
    test_guard.train(tmp_path, 2, *args, "poison.ids=300", "run.name=poisoned")
    test_guard.train(tmp_path, 2, *args, "guard.skip=9", "guard.drop=300@1", "run.name=skipped")
    run_dir = tmp_path / "runs" / "poisoned"
    replays = [(r["verdict"], r["first"] == r["replay"]) for r in test_guard.rows(run_dir, "replay")]
    assert replays == [("reproduced", True)]
    assert [(r["steps"], r["bad_samples"]) for r in test_guard.rows(run_dir, "skip")] == [([9, 9], [[300, 0]])]
    assert same_weights(run_dir, tmp_path / "runs" / "skipped")


UNFUSED = """

class UnfusedLine(Line):
    def configure_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)  # torch's default: not fused
"""


def test_a_run_with_fp16_and_an_unfused_optimizer_stops_at_start_under_sync_debug_error(launcher: Launcher) -> None:
    """The refusal reaches a real launch: exit 2, one line, before the run directory exists."""
    path = write_line_task(launcher.cwd)
    path.write_text(path.read_text() + UNFUSED)
    cmd = launcher.cmd_train("task=line_task.py:UnfusedLine", *LINE_RUN, "train.precision=fp16", "run.name=u")
    res = launcher.run(cmd, env=base_env(DDP_SLURM_SYNC_DEBUG="error"))
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "train.precision=fp16 with an optimizer that is not fused (SGD)" in errors[0], (
        res.stderr[-3000:]
    )
    assert not (launcher.cwd / "runs" / "u").exists()
