"""train.deterministic (train/determinism.py) and the precision check (train/precision.py).

No GPU here: the CUDA cases pass a ``cuda`` device object (creating one needs no GPU) and, for the
compute capability, monkeypatch ``torch.cuda``'s answers; benchmarks/gpu_check.sh checks the same on
a real GPU (bf16 training, deterministic interrupt-and-resume).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from ddp_slurm import config
from ddp_slurm.config import ConfigError
from ddp_slurm.tasks.mnist import data, models
from ddp_slurm.train import determinism
from ddp_slurm.train.optim import make_optimizer
from ddp_slurm.train.precision import check_precision


@pytest.fixture
def torch_flags() -> Iterator[None]:
    """determinism.apply changes process-wide torch flags: put them back for the other tests."""
    saved = (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
    )
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[:2]
    torch.use_deterministic_algorithms(saved[2])


def test_off_touches_nothing(torch_flags: None) -> None:
    torch.use_deterministic_algorithms(False)
    environ: dict[str, str] = {}
    assert determinism.apply(False, torch.device("cuda", 0), environ) == []
    assert environ == {} and not torch.are_deterministic_algorithms_enabled()


def test_on_sets_every_switch(torch_flags: None) -> None:
    torch.backends.cudnn.benchmark = True
    environ: dict[str, str] = {}
    done = determinism.apply(True, torch.device("cuda", 0), environ)
    assert environ == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.are_deterministic_algorithms_enabled()
    assert done == [
        "CUBLAS_WORKSPACE_CONFIG=:4096:8",
        "cudnn.deterministic",
        "cudnn.benchmark off",
        "use_deterministic_algorithms",
    ]


@pytest.mark.parametrize(("before", "after"), [(":16:8", ":16:8"), (":4096:8", ":4096:8"), ("4096", ":4096:8")])
def test_a_valid_cublas_setting_is_kept(torch_flags: None, before: str, after: str) -> None:
    environ = {"CUBLAS_WORKSPACE_CONFIG": before}
    determinism.apply(True, torch.device("cuda", 0), environ)
    assert environ == {"CUBLAS_WORKSPACE_CONFIG": after}


def test_cpu_needs_no_cublas_variable(torch_flags: None) -> None:
    environ: dict[str, str] = {}
    determinism.apply(True, torch.device("cpu"), environ)
    assert environ == {} and torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_training_steps_run_and_repeat_under_deterministic_algorithms(torch_flags: None, model_name: str) -> None:
    """With use_deterministic_algorithms on, training steps of both models with the package's optimizer
    (fused where torch has it) meet no op that refuses, and two runs from the same seed end equal."""
    determinism.apply(True, torch.device("cpu"), {})
    train = data.load_sample(train=True)
    cfg = config.load(overrides=[f"model.name={model_name}"]).train

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = models.build(model_name)
        opt = make_optimizer(cfg, model.parameters(), torch.device("cpu"))
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
        for i in range(4):
            batch = order[i * 32 : (i + 1) * 32]
            loss = F.cross_entropy(model(data.normalize(train.images[batch])), train.labels[batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_deterministic_is_a_config_key() -> None:
    assert config.load().train.deterministic is False
    assert config.load(overrides=["train.deterministic=true"]).train.deterministic is True
    with pytest.raises(ConfigError, match=r"train.deterministic in the command line: expected true or false"):
        config.load(overrides=["train.deterministic=3"])
    old, new = config.load(), config.load(overrides=["train.deterministic=true"])
    assert config.incompatible_changes(old, new) == ["train.deterministic: False -> True"]  # other bits: no resume


# ------------------------------------------------------------------------------ precision
def test_fp32_runs_anywhere() -> None:
    check_precision("fp32", torch.device("cpu"))
    check_precision("fp32", torch.device("cuda", 0))  # no CUDA call for fp32: nothing to ask the GPU


@pytest.mark.parametrize(
    ("capability", "name", "refused"),
    [
        ((7, 0), "Tesla V100-SXM2-32GB", True),
        ((7, 5), "Tesla T4", True),
        ((8, 0), "NVIDIA A100", False),
        ((9, 0), "NVIDIA H100", False),
    ],
)
def test_bf16_needs_compute_capability_8(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str, refused: bool
) -> None:
    """The GPU's answers are fabricated (monkeypatched torch.cuda): no GPU on the test machines."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    if not refused:
        check_precision("bf16", torch.device("cuda", 0))
        return
    with pytest.raises(ConfigError) as info:
        check_precision("bf16", torch.device("cuda", 0))
    message = str(info.value)
    assert "\n" not in message
    assert f"cuda:0 is a {name} ({capability[0]}.{capability[1]})" in message, message
    assert message.startswith("train.precision=bf16 needs a GPU of compute capability 8.0 or newer"), message
    assert message.endswith(
        "use train.precision=fp16 (fp16 tensor cores, with a gradient scaler) or train.precision=fp32"
    )
