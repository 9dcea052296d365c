"""``bench memory`` and ``bench checkpoint --strategy fsdp``: small models, real ranks, every figure there."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bench import bench, positive


def test_memory_fsdp_holds_a_share_of_the_model_state(tmp_path: Path) -> None:
    """At 2 ranks each FSDP rank holds about half of DDP's parameters, gradients and Adam state."""
    p, text = bench(tmp_path, "memory", "--world", "2", "--width", "64", "--depth", "2", "--steps", "1", "--batch", "8")
    assert set(p["strategies"]) == {"ddp", "fsdp"} and p["params"]["world"] == 2
    ddp, fsdp = p["strategies"]["ddp"], p["strategies"]["fsdp"]
    assert ddp["num_params"] == fsdp["num_params"] == 2 * (64 * 64 + 64) + 64 + 1
    for r in ddp["ranks"]:  # DDP: every rank the whole model, its gradients and two Adam moments (+ step counts)
        assert r["param_bytes"] == r["grad_bytes"] == 4 * ddp["num_params"]
        assert r["optimizer_bytes"] >= 2 * r["param_bytes"]
    assert sum(r["param_bytes"] for r in fsdp["ranks"]) == 4 * fsdp["num_params"]
    assert p["fsdp_over_ddp"] == pytest.approx(fsdp["model_state_bytes"] / ddp["model_state_bytes"])
    assert p["fsdp_over_ddp"] <= 1 / 2 + 0.1
    assert positive(ddp["step_s"]) and positive(fsdp["step_s"])
    assert "fsdp_over_ddp" in text and not list(tmp_path.glob(".bench-memory-*"))
    a = p["activations"]  # Linear+ReLU blocks keep each block's input either way (and the head's), and the error
    assert a["model"] == "stack" and a["kind"] == "saved tensors for backward"
    assert a["bytes_off"] == a["bytes_on"] == 3 * 8 * 64 * 4 + 8 * 4 and a["ratio"] == 1.0
    assert "activation memory of one step" in text and "ratio (true / false) = 1.000" in text


def test_activation_checkpointing_keeps_a_fraction_of_the_saved_tensors() -> None:
    """Blocks that save more than their input (GELU between two linears, as in a transformer's MLP) keep
    only their inputs with it on: one input of 4 x 8 floats per block (and the output, squared outside),
    against the input and two hidden 4 x 32 tensors each without."""
    import torch
    from torch import nn

    from ddp_slurm.bench import activations

    def build():
        blocks = [nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3)]
        return nn.Sequential(*blocks), blocks, torch.randn(4, 8), lambda m, x: m(x).square().mean()

    got = activations.compare(build, torch.device("cpu"))
    assert got["bytes_on"] == (3 + 1) * 4 * 8 * 4
    assert got["bytes_off"] == 3 * (4 * 8 + 2 * 4 * 32) * 4 + 4 * 8 * 4
    assert got["ratio"] == got["bytes_on"] / got["bytes_off"] < 0.15


def test_memory_measures_a_tasks_activations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--task``: the addition example's model (its units: embedding, encoder, norm, head), a real batch."""
    import torch
    from tasks_helpers import ADDITION

    from ddp_slurm.bench import activations

    monkeypatch.chdir(tmp_path)  # the task generates its data under the working directory
    cpu = torch.device("cpu")
    got = activations.compare(activations.task_model(ADDITION, 16, cpu), cpu)
    assert 0 < got["bytes_on"] < got["bytes_off"] / 5


@pytest.mark.parametrize(
    "flag, says",
    [(["--strategy", "ddp,zero3"], "--strategy 'ddp,zero3'"), (["--task", "nope.py:X"], "--task nope.py:X: ")],
    ids=["strategy", "task"],
)
def test_memory_refuses_an_unknown_strategy_or_task(tmp_path: Path, flag: list[str], says: str) -> None:
    import subprocess
    import sys

    from conftest import base_env

    res = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.bench", "memory", *flag],
        cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and says in res.stderr, res.stderr


def test_checkpoint_fsdp_smoke(tmp_path: Path) -> None:
    """Sharded checkpoint stall, async against sync, at 1 and 2 ranks."""
    p, text = bench(tmp_path, "checkpoint", "--strategy", "fsdp", "--state-mb", "2", "--rounds", "1")
    assert p["strategy"] == "fsdp" and set(p["worlds"]) == {"1", "2"}
    for r in p["worlds"].values():
        assert positive(r["sync_stall_s"]) and positive(r["async_stall_s"]) and positive(r["async_call_s"])
        assert r["shard_bytes"] > 2 * 2**20 * 0.9
        assert r["stop_to_durable_s"] > 0
    assert p["stall_ratio"] == pytest.approx(p["async_stall_s"] / p["sync_stall_s"])
    assert "sharded checkpoint stall" in text and not list(tmp_path.glob(".bench-checkpoint-fsdp-*"))


def test_memory_refuses_an_accumulation_that_does_not_split_the_batch(tmp_path: Path) -> None:
    import subprocess
    import sys

    from conftest import base_env

    for value, says in (("3", "--accumulate 3: must divide the 32 samples"), ("64", "an integer from 1 to 32")):
        res = subprocess.run(
            [sys.executable, "-m", "ddp_slurm.bench", "memory", "--accumulate", value],
            cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and says in res.stderr, res.stderr
