"""Data: the bundled sample, the per-epoch order and its sharding, exact distributed evaluation, full MNIST.

Distributed evaluation runs in real processes joined by a gloo process group; the "no network"
cases point urllib at a closed local port (or at a local server that never answers), so they behave
the same on a machine with internet.
"""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path

import helpers
import pytest
import torch
from conftest import base_env

from ddp_slurm.config import TrainConfig
from ddp_slurm.tasks.mnist import data, models
from ddp_slurm.tasks.mnist.data import DataError
from ddp_slurm.train import loader
from ddp_slurm.train.optim import make_optimizer, make_scheduler

SAMPLE_DIR = Path(str(resources.files("ddp_slurm") / "assets" / "mnist-sample"))


@pytest.fixture(scope="module")
def sample_train() -> data.Split:
    return data.load_sample(train=True)


@pytest.fixture(scope="module")
def sample_test() -> data.Split:
    return data.load_sample(train=False)


# --------------------------------------------------------------------------- the bundled sample


def test_sample_train_split(sample_train: data.Split) -> None:
    assert len(sample_train) == 5000 == data.TRAIN_SIZES["sample"]
    assert sample_train.images.shape == (5000, 28, 28) and sample_train.images.dtype == torch.uint8
    assert sample_train.labels.shape == (5000,) and sample_train.labels.dtype == torch.int64
    assert torch.bincount(sample_train.labels, minlength=10).tolist() == [500] * 10
    assert 0 < sample_train.images.float().mean() < 255  # real pictures, not a blank or saturated tensor


def test_sample_test_split(sample_test: data.Split, sample_train: data.Split) -> None:
    assert len(sample_test) == 5000
    assert sample_test.images.shape == (5000, 28, 28) and sample_test.images.dtype == torch.uint8
    assert set(sample_test.labels.unique().tolist()) == set(range(10))
    assert not torch.equal(sample_test.images[:100], sample_train.images[:100])


def test_load_split_dispatches(sample_train: data.Split) -> None:
    split = data.load_split("sample", "ignored", train=True)
    assert torch.equal(split.images, sample_train.images) and torch.equal(split.labels, sample_train.labels)


def test_normalize(sample_train: data.Split) -> None:
    x = data.normalize(sample_train.images[:512])
    assert x.shape == (512, 1, 28, 28) and x.dtype == torch.float32
    assert abs(x.mean().item()) < 0.2 and 0.8 < x.std().item() < 1.2  # standardised with MNIST's statistics
    assert sample_train.images[:512].dtype == torch.uint8  # the stored data is untouched


# --------------------------------------------------------------------------- order and sharding


# --------------------------------------------------------------------------- exact distributed evaluation

EVAL_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from ddp_slurm.tasks.mnist import data
    import helpers
    from ddp_slurm.train.optim import make_optimizer, make_scheduler
    from ddp_slurm.tasks.mnist import models

    rank, world_size, store, weights, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world_size)
    model = models.build("mlp")
    model.load_state_dict(torch.load(weights, weights_only=True))
    accuracy, images, loss = helpers.mnist_evaluate(model, data.load_sample(train=False), rank, world_size)
    with open(out, "w") as f:
        json.dump({"accuracy": accuracy, "images": images, "loss": loss}, f)
    if world_size > 1:
        dist.destroy_process_group()
""")


def _trained(name: str, train: data.Split, steps: int = 25) -> torch.nn.Module:
    """A briefly trained model: better than chance (and, for the cnn, batch-norm statistics that are not
    the initial ones), so that a wrong count or a wrong mode shows in the accuracy."""
    torch.manual_seed(0)
    model = models.build(name)
    cfg = TrainConfig(lr=4e-3, schedule="constant")
    optimizer = make_optimizer(cfg, model.parameters(), torch.device("cpu"))
    scheduler = make_scheduler(cfg, optimizer, steps)
    step = helpers.mnist_step(model, optimizer, scheduler, train)
    perm = loader.epoch_permutation(len(train), 0, 0)
    losses = [step(perm[loader.rank_slice(i, 64, 0, 1)]).item() for i in range(steps)]
    assert losses[-1] < losses[0], losses
    return model


@pytest.mark.slow
def test_distributed_evaluation_is_exact(tmp_path: Path, sample_train: data.Split, sample_test: data.Split) -> None:
    """The same weights evaluated by 1, 2 and 3 real processes (gloo): the same accuracy, 5000 images."""
    model = _trained("mlp", sample_train)
    weights = tmp_path / "weights.pt"
    torch.save(model.state_dict(), weights)
    reference = helpers.mnist_evaluate(model, sample_test, rank=0, world_size=1)
    assert reference[1] == 5000 and reference[0] > 0.5, reference

    script = tmp_path / "eval_rank.py"
    script.write_text(EVAL_SCRIPT)
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    for world_size in (1, 2, 3):
        store = tmp_path / f"store-{world_size}"
        for rank in range(world_size):
            out = tmp_path / f"out-{world_size}-{rank}.json"
            procs[world_size, rank] = subprocess.Popen(
                [sys.executable, str(script), str(rank), str(world_size), str(store), str(weights), str(out)],
                env=base_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
    for key, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"world {key[0]} rank {key[1]} failed:\n{output}"
    for world_size, rank in procs:
        result = json.loads((tmp_path / f"out-{world_size}-{rank}.json").read_text())
        # every rank gets the all-reduced totals: each test image counted exactly once
        assert result["images"] == 5000, (world_size, rank, result)
        assert result["accuracy"] == reference[0], (world_size, rank, result, reference)
        assert result["loss"] == pytest.approx(reference[2], rel=1e-5), (world_size, rank, result, reference)


def test_evaluation_does_not_depend_on_how_the_test_set_is_cut(
    sample_train: data.Split, sample_test: data.Split
) -> None:
    """Ranks evaluate shards of unequal size: with batch norm in training mode the answer would depend
    on the cut. Two uneven pieces must add up to the whole, and the model's mode must be handed back."""
    model = _trained("cnn", sample_train, steps=8)
    test = data.Split(sample_test.images[:1000], sample_test.labels[:1000])
    model.train()
    whole = helpers.mnist_evaluate(model, test, 0, 1, batch=256)
    assert model.training, "evaluate must hand the model back in the mode it found it"
    a = helpers.mnist_evaluate(model, data.Split(test.images[:333], test.labels[:333]), 0, 1, batch=100)
    b = helpers.mnist_evaluate(model, data.Split(test.images[333:], test.labels[333:]), 0, 1, batch=256)
    assert (a[1], b[1], whole[1]) == (333, 667, 1000)
    assert round(a[0] * 333) + round(b[0] * 667) == round(whole[0] * 1000)
    assert (a[2] * 333 + b[2] * 667) / 1000 == pytest.approx(whole[2], rel=1e-4)
    model.eval()
    helpers.mnist_evaluate(model, test, 0, 1)
    assert not model.training


# --------------------------------------------------------------------------- full MNIST


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _offline_env(port: int) -> dict[str, str]:
    """A child environment whose every HTTP(S) request goes to a closed local port: no network, at once."""
    proxy = f"http://127.0.0.1:{port}"
    env = base_env()
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env[name] = proxy
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    return env


def test_missing_mnist_without_download_fails_at_once(tmp_path: Path) -> None:
    root = tmp_path / "mnist-root"
    with pytest.raises(DataError) as info:
        data.ensure_mnist(root, allow_download=False, is_main=True)
    message = str(info.value)
    assert "\n" not in message
    assert str(root) in message and f"python -m ddp_slurm.data download --root {root}" in message
    assert "data.download" in message
    assert not root.exists(), "nothing may be created when downloading is off"
    with pytest.raises(DataError, match="python -m ddp_slurm.data download"):
        data.load_mnist(root, train=True)


def test_non_main_ranks_never_download(tmp_path: Path) -> None:
    data.ensure_mnist(tmp_path / "r", allow_download=True, is_main=False)  # returns, fetches nothing
    assert not (tmp_path / "r").exists()


def test_full_mnist_is_read_with_torchvision(tmp_path: Path, sample_train: data.Split, sample_test: data.Split) -> None:
    """torchvision's reader on raw IDX files (here: the sample's, unpacked where full MNIST would be)."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in SAMPLE_DIR.glob("*.gz"):
        (raw / gz.stem).write_bytes(gzip.decompress(gz.read_bytes()))
    data.ensure_mnist(tmp_path, allow_download=False, is_main=True)  # present: nothing to do
    for train, expected in ((True, sample_train), (False, sample_test)):
        split = data.load_split("mnist", tmp_path, train=train)
        assert split.images.dtype == torch.uint8 and split.labels.dtype == torch.int64
        assert torch.equal(split.images, expected.images) and torch.equal(split.labels, expected.labels)


@pytest.mark.slow
def test_train_with_missing_mnist_and_download_off(tmp_path: Path) -> None:
    """As a real process: one error line naming the directory and the download command, exit 2 before
    anything starts (a usage error: nothing is created)."""
    root = tmp_path / "nowhere"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp_slurm.train",
            "data.source=mnist",
            f"data.root={root}",
            "data.download=false",
            "model.name=mlp",
        ],
        cwd=tmp_path,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("ddp_slurm.train: error: full MNIST not found"), (
        res.stderr
    )
    assert str(root) in res.stderr and f"python -m ddp_slurm.data download --root {root}" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory, no data directory


@pytest.mark.slow
def test_train_with_download_on_and_no_network(tmp_path: Path) -> None:
    root = tmp_path / "mnist-root"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp_slurm.train",
            "data.source=mnist",
            f"data.root={root}",
            "data.download=true",
            "model.name=mlp",
        ],
        cwd=tmp_path,
        env=_offline_env(_closed_port()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr  # missing data is bad input, like a missing file
    errors = [line for line in res.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, res.stderr
    assert "could not download MNIST" in errors[0] and str(root) in errors[0]
    assert f"python -m ddp_slurm.data download --root {root}" in errors[0]
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the download's folders removed, no run directory


@pytest.mark.slow
def test_download_command_without_network(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.data", "download", "--root", str(tmp_path / "d")],
        cwd=tmp_path,
        env=_offline_env(_closed_port()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: could not download MNIST to ") and str(tmp_path / "d") in lines[0]


BLACKHOLE_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from torchvision.datasets import MNIST
    from ddp_slurm.tasks.mnist import data

    MNIST.mirrors = [sys.argv[1]]  # a server that accepts connections and never answers
    try:
        data.download(Path(sys.argv[2]), timeout_s=2.0)
    except Exception as exc:
        print("failed:", type(exc).__name__, data.one_line(exc))
        sys.exit(0)
    sys.exit("download succeeded from a server that never answers")
""")


@pytest.mark.slow
def test_download_gives_up_on_a_server_that_never_answers(tmp_path: Path) -> None:
    """A firewalled node that drops packets must not hang: the socket timeout ends the attempt.
    Without one, this child would block until the test's own timeout and fail."""
    script = tmp_path / "blackhole.py"
    script.write_text(BLACKHOLE_SCRIPT)
    with socket.socket() as server:  # listening but never accepting: the kernel completes the handshake
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/"
        env = base_env(no_proxy="*", NO_PROXY="*")
        res = subprocess.run(
            [sys.executable, str(script), url, str(tmp_path / "d")],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "failed:" in res.stdout
    assert "\n" not in res.stdout.strip()
