"""Models: output shapes, parameter counts, FLOP estimates, and a training step that learns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp_slurm.tasks.mnist import data, models


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", models.MODELS)
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_forward_shape(name: str, batch: int) -> None:
    model = models.build(name).eval()
    with torch.no_grad():
        out = model(torch.randn(batch, 1, 28, 28))
    assert out.shape == (batch, 10) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_mlp_is_784_100_10() -> None:
    model = models.build("mlp")
    assert _params(model) == 784 * 100 + 100 + 100 * 10 + 10 == 79_510
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 100), (100, 10)]
    assert model.flops_per_sample() == 2 * (784 * 100 + 100 * 10)


def test_cnn_parameter_count() -> None:
    model = models.build("cnn")
    w = model.width
    convs = 1 * w * 25 + w * 2 * w * 9 + 2 * w * 4 * w * 9  # bias-free: batch norm follows each conv
    norms = 2 * (w + 2 * w + 4 * w)
    head = 4 * w * 9 * 10 + 10  # on the flattened 3x3 map
    assert _params(model) == convs + norms + head
    assert _params(model) < 100_000  # small: an epoch of the sample is seconds on a CPU


@pytest.mark.parametrize("name", models.MODELS)
def test_flops_per_sample(name: str) -> None:
    model = models.build(name)
    flops = model.flops_per_sample()
    assert isinstance(flops, int) and flops > 0
    assert flops >= 2 * _params(model) * 0.9  # every weight is used at least once per sample


def test_cnn_costs_more_than_mlp() -> None:
    assert models.build("cnn").flops_per_sample() > models.build("mlp").flops_per_sample()


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="resnet.*mlp, cnn"):
        models.build("resnet")


@pytest.mark.parametrize("name", models.MODELS)
def test_same_seed_same_weights(name: str) -> None:
    torch.manual_seed(3)
    a = models.build(name).state_dict()
    torch.manual_seed(3)
    b = models.build(name).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", models.MODELS)
def test_forward_backward_on_real_batch(name: str) -> None:
    """One batch of real digits: the loss falls when the model is fitted to it for a few steps."""
    torch.manual_seed(0)
    split = data.load_sample(train=True)
    x, y = data.normalize(split.images[:32]), split.labels[:32]
    model = models.build(name)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name", models.MODELS)
def test_ddp_steps_of_each_model_warn_nothing(tmp_path, name: str) -> None:
    """The first lines a newcomer sees: DDP as the runtime wraps a model (buckets settled, gradients as bucket
    views) warns nothing in its steps. The cnn's 1-channel stem weight in channels_last strides got gradients
    with NCHW strides, and every run printed PyTorch's "Grad strides do not match bucket view strides"."""
    import warnings

    import torch.distributed as dist

    from ddp_slurm.train import ddp

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = models.build(name)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            wrapped = ddp.wrap_ddp(model, torch.device("cpu"), world_size=2, settle=True)  # 2: wraps on one rank
            for _ in range(2):
                wrapped(torch.randn(4, 1, 28, 28)).sum().backward()
        assert not [str(w.message) for w in seen]
        mismatched = {n: p.stride() for n, p in model.named_parameters() if p.stride() != p.grad.stride()}
        assert not mismatched, mismatched
    finally:
        dist.destroy_process_group()
