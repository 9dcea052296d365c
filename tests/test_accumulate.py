"""``train.accumulate`` and ``train.grad_clip``: the step's arithmetic in process, the same at 2 real
ranks under ddp and fsdp (FSDP's gradients stay sharded between micro-batches), then real training
through torchrun (DDP's ``no_sync`` path at 2 ranks), a stop signal and an exact resume."""

from __future__ import annotations

import json
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import helpers
import pytest
import test_resume
import torch
from conftest import Launcher
from test_resume import Launch, assert_resumed_from, assert_stopped, run_to_end, start
from torch import nn

from ddp_slurm.config import ConfigError, TrainConfig, accumulation, check_world_size, from_dict
from ddp_slurm.train import accumulate, checkpoint, step
from ddp_slurm.train.optim import make_optimizer, make_scheduler

MLP = [
    "model.name=mlp",
    "train.global_batch_size=64",
    "train.epochs=1",
    "train.log_every_steps=2",
    "checkpoint.every_steps=10",
    "checkpoint.keep=100",
    "run.name=r",
]


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    """test_resume's fixture: the launches of a test, any still running killed at its end."""
    yield from test_resume.launches.__wrapped__()


def test_split_cuts_every_tensor_of_a_nested_batch() -> None:
    batch = (torch.arange(8), {"y": torch.arange(8) * 2, "tag": "t"})
    parts = accumulate.split(batch, 4)
    assert len(parts) == 4 and torch.equal(parts[1][0], torch.tensor([2, 3]))
    assert torch.equal(parts[3][1]["y"], torch.tensor([12, 14])) and parts[3][1]["tag"] == "t"
    with pytest.raises(ValueError, match="does not split into train.accumulate=3"):
        accumulate.split(torch.zeros(8), 3)


def _trained(accumulate_n: int, clip: float | None) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    cfg = TrainConfig(optimizer="sgd", lr=0.1, schedule="constant")
    opt = make_optimizer(cfg, model.parameters(), torch.device("cpu"))
    sched = make_scheduler(cfg, opt, 10)
    train_step = step.make_step(
        model,
        opt,
        sched,
        lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
        torch.device("cpu"),
        accumulate=accumulate_n,
        grad_clip=clip,
    )
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
    loss = train_step((x, y))
    return model, (loss, getattr(train_step, "grad_norm", None))


def test_accumulated_micro_batches_take_the_step_of_the_whole_batch() -> None:
    """4 micro-batches of 4 samples step the weights as one batch of 16 does (up to float rounding), and
    the loss returned is the mean over the whole batch."""
    whole, (loss1, _) = _trained(1, None)
    parts, (loss4, _) = _trained(4, None)
    for a, b in zip(whole.parameters(), parts.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss1, loss4)


def test_clipping_bounds_the_update_and_reports_the_norm_before_it() -> None:
    torch.manual_seed(0)
    free, (_, none) = _trained(1, None)
    clipped, (_, norm) = _trained(1, 1e-3)
    assert none is None and norm is not None and norm.item() > 1e-3
    FIRST = 0.1 * (1 + 0.9)  # SGD's first step moves lr x (1 + momentum) x the gradient (Nesterov)
    torch.manual_seed(0)
    start_weights = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    moved = torch.cat([(a - b).flatten() for a, b in zip(clipped.parameters(), start_weights.parameters())])
    assert moved.norm().item() == pytest.approx(FIRST * 1e-3, rel=1e-3)
    unclipped = torch.cat([(a - b).flatten() for a, b in zip(free.parameters(), start_weights.parameters())])
    assert unclipped.norm().item() == pytest.approx(FIRST * norm.item(), rel=1e-3)


TWO_RANKS = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import ddp_slurm
    from ddp_slurm.bench.strategy_worker import held_grad_bytes, local_bytes
    from ddp_slurm.config import TrainConfig
    from ddp_slurm.train import accumulate, step, strategy
    from ddp_slurm.train.optim import make_optimizer, make_scheduler
    from ddp_slurm.train.task import Task

    rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own share of the global batch
    batches = [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(3)]

    def loss_of(m, b):
        return ((m(b[0]) - b[1]) ** 2).mean()

    def trained(name, n):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 1))
        net = strategy.of(name).wrap(model, Task(None, None), cpu, "fp32", 2)
        cfg = TrainConfig(optimizer="adam", lr=0.01, schedule="constant")
        opt = make_optimizer(cfg, model.parameters(), cpu)
        train_step = step.make_step(net, opt, make_scheduler(cfg, opt, 10), loss_of, cpu, accumulate=n)
        losses = [train_step(b).item() for b in batches]
        full = [getattr(p, "full_tensor", lambda p=p: p)().detach().tolist() for p in model.parameters()]
        return model, net, full, losses

    result = {}
    for name in ("ddp", "fsdp"):
        _, _, one, loss1 = trained(name, 1)
        model, net, two, loss2 = trained(name, 2)
        # a micro-batch that is not the last: what the rank holds after its backward
        with accumulate.no_sync(net):
            loss_of(net, (batches[0][0][:4], batches[0][1][:4])).backward()
        own = sum(local_bytes(p) for p in model.parameters())
        result[name] = {"one": one, "two": two, "loss1": loss1, "loss2": loss2,
                        "held": held_grad_bytes(model), "own": own}
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    ddp_slurm.exit_now(0)  # a DDP reducer keeps gloo's threads alive past the destroy (see test_step)
""")


def test_two_ranks_accumulate_as_one_batch_under_ddp_and_fsdp(tmp_path: Path) -> None:
    """2 ranks, the same global batch: 3 Adam steps with accumulate=2 end within float rounding of
    accumulate=1, under ddp and fsdp alike; after a micro-batch that is not the last, an fsdp rank holds
    only its shard of the gradient (the size of its parameter shard), a ddp rank the whole of it."""
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS)
    r0, r1 = helpers.two_ranks(script, tmp_path)
    whole = 4 * (4 * 8 + 8 + 8 + 1)  # fp32 bytes of the whole model
    for name in ("ddp", "fsdp"):
        for r in (r0, r1):
            got = r[name]
            for a, b in zip(got["one"], got["two"]):
                torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)
            assert got["loss1"] == pytest.approx(got["loss2"], rel=1e-5, abs=1e-6)
        assert r0[name]["one"] == r1[name]["one"]  # every rank ends with the same model
    assert r0["ddp"]["held"] == r0["ddp"]["own"] == whole
    for r in (r0, r1):  # sharded: the gradient bytes held are the rank's parameter shard, not the whole
        assert r["fsdp"]["held"] == r["fsdp"]["own"] < whole
    assert r0["fsdp"]["own"] + r1["fsdp"]["own"] == whole


def test_a_batch_that_does_not_split_is_refused_in_one_line() -> None:
    cfg = from_dict({"train": {"global_batch_size": 64, "accumulate": 3}})
    with pytest.raises(ConfigError, match=r"does not split into 2 rank\(s\) x train.accumulate=3 .* multiple of 6"):
        check_world_size(cfg, 2)
    check_world_size(from_dict({"train": {"global_batch_size": 64, "accumulate": 4}}), 2)
    with pytest.raises(ConfigError, match="train.accumulate"):
        from_dict({"train": {"accumulate": 0}})
    with pytest.raises(ConfigError, match="train.grad_clip"):
        from_dict({"train": {"grad_clip": -1.0}})


def test_a_micro_batch_size_chooses_the_accumulation_for_each_world_size() -> None:
    """train.micro_batch_size: any node count keeps the global batch and each rank's micro-batch, or is refused."""
    cfg = from_dict({"train": {"global_batch_size": 48, "micro_batch_size": 8}})
    assert [accumulation(cfg, world) for world in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(
        ConfigError, match=r"does not split into 4 rank\(s\) x micro-batches of train.micro_batch_size=8"
    ):
        check_world_size(cfg, 4)
    with pytest.raises(ConfigError, match="leave train.accumulate at 1"):
        accumulation(from_dict({"train": {"micro_batch_size": 8, "accumulate": 2}}), 1)


def test_a_run_with_a_micro_batch_size_says_which_accumulation_it_chose(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    run = ["model.name=mlp", "train.max_steps=6", "train.global_batch_size=48", "train.micro_batch_size=8"]
    for nproc in (1, 3):
        cmd = (
            launcher.cmd_train(*run, "run.name=one") if nproc == 1 else launcher.cmd_torchrun(3, *run, "run.name=three")
        )
        launcher.run(cmd, check=True)
    for name, want in (("one", 6), ("three", 2)):
        rows = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["accumulate"] for r in rows if r["kind"] == "start"] == [want]


def test_accumulate_trains_as_well_resumes_exactly_and_logs_the_norm(launches: list[Launch], tmp_path: Path) -> None:
    """Two ranks, the same global batch: accumulate=4 ends in the accuracy band of accumulate=1. With
    accumulate=4 and grad_clip, SIGUSR2 mid-epoch stops both ranks at an optimizer step (the signal
    comes while some micro-batch runs), and the relaunch ends bit-identical to the run left alone;
    grad_norm is in the train lines and in TensorBoard."""
    accumulated = [*MLP, "train.accumulate=4", "train.grad_clip=5.0", "log.tensorboard=true"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "ref").mkdir()
    plain = run_to_end(launches, tmp_path / "plain", 2, MLP)
    reference = run_to_end(launches, tmp_path / "ref", 2, accumulated)
    accuracy = [r["accuracy"] for r in reference.rows() if r["kind"] == "eval"][-1]
    assert abs(accuracy - [r["accuracy"] for r in plain.rows() if r["kind"] == "eval"][-1]) < 0.01, accuracy
    norms = [r["grad_norm"] for r in reference.rows() if r["kind"] == "train"]
    assert norms and all(n > 0 for n in norms)
    assert not [r for r in plain.rows() if "grad_norm" in r]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(reference.run_dir / "tensorboard"))
    events.Reload()
    assert "train/grad_norm" in events.Tags()["scalars"]

    first = start(launches, tmp_path, 2, accumulated)
    first.wait_until_catching(signal.SIGUSR2)
    first.wait_for_row("training to pass step 10", lambda r: r["kind"] == "train" and r["step"] >= 10)
    first.signal(1, signal.SIGUSR2)
    first.sigterm_during_shutdown()
    stop = assert_stopped(first)
    second = run_to_end(launches, tmp_path, 2, accumulated)
    assert_resumed_from(second, stop["step"])
    got, want = checkpoint.load_latest(first.run_dir), checkpoint.load_latest(reference.run_dir)
    assert got is not None and want is not None and got["step"] == want["step"]
    assert all(torch.equal(t, want["model"][k]) for k, t in got["model"].items())
