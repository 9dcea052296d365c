"""train/step.py: the stop vote (one step late, the same on every rank) and evaluation of rank 0's model.

The 2-rank tests run real processes joined over gloo.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import helpers
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddp_slurm.tasks.mnist import data, models
from ddp_slurm.train import step as train_step
from ddp_slurm.train.ddp import bucket_cap_mb
from ddp_slurm.train.signals import StopFlag
from ddp_slurm.train.vote import StopVote, _Staged

FINE = torch.tensor(0.5)


def test_a_signal_is_agreed_one_step_late() -> None:
    stop = StopFlag()  # not installed: the test sets what a handler would
    votes = StopVote(stop, 1, torch.device("cpu"))
    assert votes.exchange(FINE, 1) == (False, False, False)
    stop.requeue_requested = True  # arrives during step 2
    assert votes.exchange(FINE, 2) == (False, False, False)  # step 1's flags
    assert votes.exchange(FINE, 3) == (True, False, False)  # step 2's
    stop.terminate_requested = True
    assert votes.exchange(FINE, 4, wait=True) == (True, True, False)  # waiting includes this step's own flags
    assert votes.settle() == (False, False, False)  # nothing left in flight


def test_settle_returns_the_last_posted_flags() -> None:
    stop = StopFlag()
    votes = StopVote(stop, 1, torch.device("cpu"))
    stop.terminate_requested = True
    assert votes.exchange(None, 0) == (False, False, False)
    assert votes.settle() == (False, True, False)
    assert votes.settle() == (False, False, False)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_loss_is_named_with_its_step(value: float) -> None:
    votes = StopVote(StopFlag(), 1, torch.device("cpu"))
    votes.exchange(FINE, 6)
    assert votes.exchange(torch.tensor(value), 7) == (False, False, False)
    assert votes.exchange(FINE, 8) == (False, False, True)
    assert votes.bad == f"loss is {value} at step 7"


def _random_signals(
    votes: StopVote, stop: StopFlag, seed: int, steps: int, bad_share: float, bad_value: float
) -> tuple[bool, bool, bool] | None:
    """Random signals, non-finite losses and save steps: each exchange must return the flags posted by
    the step before (plus its own with wait=True). Returns what the last exchange posted, if unread."""
    import random

    rng = random.Random(seed)
    posted: tuple[bool, bool, bool] | None = None  # what the previous exchange posted, if not yet read
    for step in range(1, steps + 1):
        stop.requeue_requested, stop.terminate_requested = rng.random() < 0.3, rng.random() < 0.3
        bad, wait = rng.random() < bad_share, rng.random() < 0.2
        now = (stop.requeue_requested, stop.terminate_requested, bad)
        got = votes.exchange(torch.tensor(bad_value if bad else 0.5), step, wait=wait)
        expected = posted or (False, False, False)
        if wait:
            expected = tuple(a or b for a, b in zip(expected, now))
        assert got == expected, (step, got, expected)
        posted = None if wait else now
    return posted


@pytest.mark.parametrize("seed", range(5))
def test_every_step_reads_exactly_the_flags_posted_one_step_before(seed: int) -> None:
    """Random signals and save steps over 60 steps: each exchange returns the flags posted by the step
    before (plus its own with wait=True), whichever of the two buffers they went through."""
    stop = StopFlag()
    votes = StopVote(stop, 1, torch.device("cpu"))
    posted = _random_signals(votes, stop, seed, steps=60, bad_share=0.1, bad_value=float("nan"))
    assert votes.settle() == (posted or (False, False, False))
    assert votes.settle() == (False, False, False)


class _Writes(TorchDispatchMode):
    """Records every op that produces a tensor on the pretend device ("meta") and flags the two ways a
    host value can enter device memory: an op that makes or fills device memory from a Python number
    (``scalar_tensor``, ``full``, ``fill_``: no device tensor in, a number in; arithmetic with a
    constant, such as isfinite's ``ne(x, inf)``, reads a device tensor and is not a write of a host
    value), and a copy from host memory without non_blocking."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        on_device = any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outs)
        if on_device:
            self.ops.append(str(func))
            bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            reads_device = any(
                isinstance(a, torch.Tensor) and a.device.type == "meta" and not (i == 0 and "fill" in str(func))
                for i, a in enumerate(args)
            )
            for arg in func._schema.arguments:
                value = bound.get(arg.name)
                if str(arg.type) in ("number", "float") and isinstance(value, (int, float)) and not reads_device:
                    self.bad.append(f"{func} writes the Python number {arg.name}={value!r} into device memory")
            hosts = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
            if hosts and not (func is torch.ops.aten.copy_.default and bound.get("non_blocking")):
                self.bad.append(f"{func} reads host memory into the device without non_blocking")
        return out


@pytest.mark.parametrize("loss", [None, "tensor"])
def test_the_vote_never_writes_a_python_number_into_a_device_buffer(loss: str | None) -> None:
    """On a GPU, a Python number written into a CUDA tensor (``flags[0] = 1.0``) is a synchronising
    host-to-device copy. The vote's device path, run here on the "meta" device that stands in for one,
    writes its device buffer only from device tensors (the non-finite flag from the loss) or from host
    memory copied with non_blocking=True (pinned on CUDA)."""
    stop = StopFlag()
    stop.requeue_requested = True
    votes = StopVote(stop, 1, torch.device("meta"), failed=lambda: True)
    value = None if loss is None else torch.tensor(0.5, device="meta")
    with _Writes() as seen:
        votes.exchange(value, 1)  # the first exchange posts and reads nothing back: no host value needed
    assert seen.ops, "the vote wrote nothing into its device buffer"
    assert seen.bad == [], seen.bad


@pytest.mark.parametrize("seed", range(2))
def test_the_staged_path_carries_the_same_flags(seed: int) -> None:
    """The device path's staging (host flags into pinned memory, one copy per step), run for real
    on CPU tensors: every exchange returns what the plain path would."""
    stop = StopFlag()
    votes = StopVote(stop, 1, torch.device("cpu"))
    votes._staged = _Staged(torch.device("cpu"))
    _random_signals(votes, stop, seed, steps=40, bad_share=0.2, bad_value=float("inf"))


class _Reads(TorchDispatchMode):
    """Counts the reads of a device value by the host (``.item()``, ``bool(t)``: ``_local_scalar_dense``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_the_weights_check_before_a_save_reads_the_device_once() -> None:
    """Non-finite weights are found whichever tensor holds them, with one host read for all tensors
    (one sync on a GPU), not one per tensor."""
    model = models.build("cnn")
    with _Reads() as reads:
        assert train_step.all_finite(model.parameters())
    assert reads.count == 1 and len(list(model.parameters())) > 2
    for bad in (float("nan"), float("inf")):
        params = [p.detach().clone() for p in model.parameters()]
        params[3][(-1,) * params[3].dim()] = bad
        assert not train_step.all_finite(params)
    assert train_step.all_finite([])


TWO_RANKS = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    import ddp_slurm
    from ddp_slurm.tasks.mnist import data
    import helpers
    from ddp_slurm.train.ddp import bucket_cap_mb, wrap_ddp
    from ddp_slurm.train.vote import StopVote
    from ddp_slurm.tasks.mnist import models
    from ddp_slurm.train.signals import StopFlag

    rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    stop = StopFlag()
    votes = StopVote(stop, 2, torch.device("cpu"))
    seen = []
    for step in range(1, 8):
        if rank == 1 and step == 3:
            stop.requeue_requested = True  # only rank 1 got the signal, during step 3
        loss = torch.tensor(float("nan") if rank == 0 and step == 5 else 0.5)
        seen.append(votes.exchange(loss, step, wait=step == 7))
    seen.append(votes.settle())

    torch.manual_seed(0)
    model = models.build("cnn")
    model.train()
    model(torch.randn(64, 1, 28, 28) * (1 + rank))  # rank-local batch-norm statistics, as in training
    before = [b.clone() for b in model.buffers()]
    result = helpers.mnist_evaluate(model, data.load_sample(train=False), rank, 2)
    net = wrap_ddp(models.build("cnn"), torch.device("cpu"), 2, settle=True)
    for _ in range(2):  # DDP logs its final layout once a step has used it
        net(torch.randn(8, 1, 28, 28)).sum().backward()
    buckets = net._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    if rank == 0:
        torch.save(model.state_dict(), sys.argv[4])
    with open(out, "w") as f:
        json.dump({"seen": seen, "bad": votes.bad, "eval": result, "buckets": buckets,
                   "buffers": [b.tolist() for b in model.buffers() if b.is_floating_point()],
                   "changed": any(not torch.equal(a, b) for a, b in zip(before, model.buffers()))}, f)
    dist.destroy_process_group()
    # Leave as ddp_slurm.train does: a DDP reducer keeps gloo's threads alive past the destroy, and
    # finalizing the interpreter beside them aborts a finished rank now and then (exit -6).
    ddp_slurm.exit_now(0)
""")


@pytest.mark.slow
def test_two_ranks_agree_at_the_same_step_and_evaluate_rank_zeros_model(tmp_path: Path) -> None:
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS)
    weights = tmp_path / "rank0.pt"
    r0, r1 = helpers.two_ranks(script, tmp_path, str(weights))

    assert r0["seen"] == r1["seen"]  # every rank reads the same flags after the same step
    requeue = [s[0] for s in r0["seen"]]
    assert requeue.index(True) == 3  # posted after step 3, read after step 4 (index 3)
    bad = [s[2] for s in r0["seen"]]
    assert bad.index(True) == 5  # step 5's NaN, read after step 6
    assert r0["bad"] == "loss is nan at step 5"
    assert r1["bad"] == "loss is not finite on another rank at step 5"

    # rank 1 evaluated with rank 0's batch-norm statistics: both report what rank 0's model scores alone
    assert r1["changed"] and not r0["changed"]
    assert r0["buffers"] == r1["buffers"]
    model = models.build("cnn")
    model.load_state_dict(torch.load(weights, weights_only=True))
    alone = helpers.mnist_evaluate(model, data.load_sample(train=False), 0, 1)
    assert r0["eval"] == r1["eval"]
    assert r0["eval"][0] == pytest.approx(alone[0], abs=1e-12) and r0["eval"][1] == alone[1] == 5000

    # the cnn's gradients (240 KiB) travel in two buckets: the head and conv3's first, while conv1-2 backward runs
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    sizes = [int(s) for s in r0["buckets"].split(",")]
    assert len(sizes) == 2 and sum(sizes) == grad_bytes and r1["buckets"] == r0["buckets"]


def test_small_models_get_two_buckets_large_ones_ddps_defaults() -> None:
    cnn = models.build("cnn")
    cap = bucket_cap_mb(cnn)
    assert cap == pytest.approx(4 * sum(p.numel() for p in cnn.parameters()) / 2 / 2**20)
    assert bucket_cap_mb(torch.nn.Linear(1024, 1024)) is None  # 4 MiB: DDP already splits it
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    assert bucket_cap_mb(frozen) is None


EVAL_VOTE = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from ddp_slurm.train import step
    from ddp_slurm.train.evaluation import EvalVote
    from ddp_slurm.train.signals import StopFlag

    rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    model = nn.Linear(1, 1)
    results = {}
    for case, stop_at in (("whole", None), ("stopped", 2)):
        stop, ran = StopFlag(), []
        vote = EvalVote(stop, 2, None)

        def metrics_of(model, batch, stop=stop, ran=ran):
            ran.append(len(batch[0]))
            if rank == 1 and len(ran) == stop_at:
                stop.requeue_requested = True  # the signal reaches rank 1 only, during its second batch
            return {"one": torch.ones(len(batch[0]))}

        sizes = [4, 4, 2] if rank == 0 else [4, 4, 4, 4, 1]  # unequal shards: 3 batches and 5
        batches = [(torch.zeros(n, 1),) for n in sizes]
        found = step.evaluate(model, batches, metrics_of, torch.device("cpu"), 2, vote=vote)
        results[case] = {"found": found, "ran": ran, "requeue": vote.requeue}
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_the_evaluation_vote_keeps_ranks_with_unequal_shards_together(tmp_path: Path) -> None:
    """``EvalVote``: ranks with 3 and 5 evaluation batches count every sample once; a stop on one rank
    abandons the evaluation on both at the same batch, the rank that took the signal finishing none after it."""
    script = tmp_path / "vote.py"
    script.write_text(EVAL_VOTE)
    r0, r1 = helpers.two_ranks(script, tmp_path)
    assert r0["whole"]["found"] == r1["whole"]["found"] == [{"one": 1.0}, 27]
    assert r0["whole"]["ran"] == [4, 4, 2] and r1["whole"]["ran"] == [4, 4, 4, 4, 1]
    assert r0["stopped"]["found"] is None and r1["stopped"]["found"] is None
    assert r0["stopped"]["ran"] == [4, 4] and r1["stopped"]["ran"] == [4, 4]  # both stopped before batch 3
    assert r0["stopped"]["requeue"] and r1["stopped"]["requeue"]
