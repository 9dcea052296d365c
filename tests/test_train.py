"""Training end to end, as real processes: 2-rank torchrun on CPU (gloo), 1 rank, relaunch, defaults.

The two mlp runs use the default settings (global batch 64, 4 epochs) and differ only in the world
size, so they double as the check that 1 and 2 processes train the same model and as the check of
the mlp accuracy target; the no-argument run is the cnn target.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import Launcher

from ddp_slurm import config
from ddp_slurm.train import checkpoint, metrics

MLP_TARGET, CNN_TARGET = 0.89, 0.96  # test accuracy on the sample with the default settings
SAMPLE_TEST_IMAGES = 5000


def _rows(run_dir: Path) -> list[dict]:
    return list(metrics.read(run_dir / "metrics.jsonl"))


def _final_accuracy(run_dir: Path) -> float:
    return [r for r in _rows(run_dir) if r["kind"] == "eval"][-1]["accuracy"]


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of a run directory with its size and mtime: what a relaunch must leave alone (the
    launch lock, rewritten by every launch, aside)."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _check_contract(run_dir: Path, overrides: list[str], world_size: int) -> list[dict]:
    """The run directory as CONTRACT.md describes it."""
    cfg = config.load(None, overrides)
    saved = config.read_resolved(run_dir / "config.yaml")
    if cfg.run.name is None:  # the launch named its new run directory
        cfg.run.name = run_dir.name
    assert saved == cfg

    rows = _rows(run_dir)
    assert (run_dir / "metrics.jsonl").read_text().endswith("\n")
    for row in rows:
        for key in ("kind", "step", "epoch", "time_s"):
            assert key in row, f"{key} missing from {row}"
        assert isinstance(row["step"], int) and isinstance(row["epoch"], int) and row["time_s"] >= 0
    kinds = [r["kind"] for r in rows]
    assert kinds[0] == "start" and kinds[-1] == "end", kinds
    assert [r["time_s"] for r in rows] == sorted(r["time_s"] for r in rows)

    steps_per_epoch = 5000 // cfg.train.global_batch_size
    total = cfg.train.epochs * steps_per_epoch
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(
        range(cfg.train.log_every_steps, total + 1, cfg.train.log_every_steps)
    )
    for row in train_rows:
        assert row["loss"] > 0 and row["samples_per_s"] > 0 and row["world_size"] == world_size
        assert row["epoch"] == (row["step"] - 1) // steps_per_epoch
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]

    eval_rows = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in eval_rows] == [steps_per_epoch * (e + 1) for e in range(cfg.train.epochs)]
    assert [r["epoch"] for r in eval_rows] == list(range(cfg.train.epochs))
    for row in eval_rows:
        assert row["test_samples"] == SAMPLE_TEST_IMAGES  # each test image exactly once, any world size
        assert 0.0 <= row["accuracy"] <= 1.0

    state = checkpoint.load_latest(run_dir)
    assert state is not None and state["step"] == total and state["finished"] is True
    assert not any(k.startswith("module.") for k in state["model"])
    saved = checkpoint.list_checkpoints(run_dir)
    assert len(saved) == cfg.checkpoint.keep and saved[0][0] == total
    assert not list((run_dir / "checkpoints").glob("*.tmp*"))
    return rows


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Launcher, list[str], object]]:
    """The mlp with the default settings, once on 2 ranks (torchrun) and once on 1 (plain python)."""
    runs = {}
    for world_size in (2, 1):
        launcher = Launcher(tmp_path_factory.mktemp(f"mlp-ws{world_size}"))
        overrides = ["model.name=mlp", f"run.name=mlp-ws{world_size}"]
        cmd = launcher.cmd_torchrun(2, *overrides) if world_size == 2 else launcher.cmd_train(*overrides)
        runs[world_size] = (launcher, overrides, launcher.run(cmd, timeout=900))
    return runs


@pytest.mark.slow
def test_two_process_torchrun_run(mlp_runs) -> None:
    launcher, overrides, res = mlp_runs[2]
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    run_dir = launcher.cwd / "runs" / "mlp-ws2"
    rows = _check_contract(run_dir, overrides, world_size=2)
    assert rows[0]["world_size"] == 2 and rows[0]["launcher"] == "torchrun"
    # rank 0 reports every epoch: loss, accuracy and throughput, and where the run is
    epoch_lines = [line for line in res.stderr.splitlines() if re.search(r"epoch \d/4: train loss", line)]
    assert len(epoch_lines) == 4 and all("test accuracy" in line and "samples/s" in line for line in epoch_lines)
    assert "runs/mlp-ws2" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_one_process_matches_two(mlp_runs) -> None:
    launcher, overrides, res = mlp_runs[1]
    assert res.returncode == 0, res.stderr
    run_dir = launcher.cwd / "runs" / "mlp-ws1"
    rows = _check_contract(run_dir, overrides, world_size=1)
    assert rows[0]["launcher"] == "single"
    one = _final_accuracy(run_dir)
    two = _final_accuracy(mlp_runs[2][0].cwd / "runs" / "mlp-ws2")
    # Same global batch, same samples per step, gradients averaged over ranks: the same model up to
    # floating-point summation order.
    assert abs(one - two) < 0.015, (one, two)
    weights_one = checkpoint.load_latest(run_dir)["model"]
    weights_two = checkpoint.load_latest(mlp_runs[2][0].cwd / "runs" / "mlp-ws2")["model"]
    for key in weights_one:
        assert torch.allclose(weights_one[key], weights_two[key], atol=1e-3), key


@pytest.mark.slow
def test_mlp_reaches_its_target_with_the_default_settings(mlp_runs) -> None:
    for world_size, (launcher, _, res) in mlp_runs.items():
        assert res.returncode == 0, res.stderr
        accuracy = _final_accuracy(launcher.cwd / "runs" / f"mlp-ws{world_size}")
        assert accuracy >= MLP_TARGET, f"world size {world_size}: mlp reached {accuracy:.2%} < {MLP_TARGET:.0%}"


@pytest.mark.slow
def test_relaunching_a_finished_run_does_nothing(mlp_runs) -> None:
    launcher, overrides, first = mlp_runs[2]
    assert first.returncode == 0, first.stderr
    run_dir = launcher.cwd / "runs" / "mlp-ws2"
    before = _snapshot(run_dir)
    res = launcher.run(launcher.cmd_torchrun(2, *overrides), timeout=600)
    assert res.returncode == 0, res.stderr
    assert "already finished" in res.stderr
    assert not re.search(r"epoch \d/4: train loss", res.stderr)  # no epoch trained or evaluated again
    after = _snapshot(run_dir)
    assert {k: v for k, v in after.items() if k != "config.yaml"} == {
        k: v for k, v in before.items() if k != "config.yaml"
    }
    assert config.read_resolved(run_dir / "config.yaml") == config.load(None, overrides)


@pytest.mark.slow
def test_max_steps_ends_training_early(launcher: Launcher) -> None:
    overrides = [
        "model.name=mlp",
        "train.max_steps=25",
        "train.log_every_steps=10",
        "checkpoint.every_steps=0",
        "run.name=capped",
    ]
    res = launcher.run(launcher.cmd_train(*overrides), timeout=600)
    assert res.returncode == 0, res.stderr
    rows = _rows(launcher.cwd / "runs" / "capped")
    assert rows[-1]["kind"] == "end" and rows[-1]["step"] == 25
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [25] and evals[0]["test_samples"] == SAMPLE_TEST_IMAGES
    assert [r["step"] for r in rows if r["kind"] == "train"] == [10, 20]
    state = checkpoint.load_latest(launcher.cwd / "runs" / "capped")
    assert state["step"] == 25 and state["finished"] is True


@pytest.mark.slow
def test_no_arguments_trains_the_cnn_on_the_sample_to_target(launcher: Launcher) -> None:
    """``python -m ddp_slurm.train`` alone: the offline default (bundled sample, cnn, 4 epochs)."""
    res = launcher.run(launcher.cmd_train(), timeout=1800)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    [run_dir] = (launcher.cwd / "runs").iterdir()  # a new directory, named for the task and the time
    assert re.fullmatch(r"mnist-\d{8}-\d{6}", run_dir.name), run_dir.name
    resolved = config.read_resolved(run_dir / "config.yaml")
    assert resolved == config.Config(run=config.RunConfig(name=run_dir.name))
    assert (resolved.data.source, resolved.model.name) == ("sample", "cnn")
    _check_contract(run_dir, [], world_size=1)
    accuracy = _final_accuracy(run_dir)
    assert accuracy >= CNN_TARGET, f"cnn reached {accuracy:.2%} < {CNN_TARGET:.0%} with the default settings"
