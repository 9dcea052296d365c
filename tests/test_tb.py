"""TensorBoard events from the records metrics.jsonl gets, read back with TensorBoard's own reader."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import skip_or_fail

from ddp_slurm import config
from ddp_slurm.config import ConfigError
from ddp_slurm.train import tb


@pytest.fixture(autouse=True)
def _tensorboard_installed() -> None:
    if importlib.util.find_spec("tensorboard") is None:  # the test extra installs it
        skip_or_fail("tensorboard is not installed: pip install -e '.[test]'")


def test_records_become_scalars_and_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = tb.open_for(config.load(None, ["log.tensorboard=true"]), tmp_path, rank=0)
    assert writer is not None
    writer.write("start", 0, 0, 0.0, world_size=2, job_id="7", nodes="node[1-2]")
    for step in (5, 10):
        writer.write("train", step, 0, step / 10, loss=1.0 / step, lr=1e-3 * step, samples_per_s=900.0, world_size=2)
    writer.write_record({"kind": "eval", "step": 10, "epoch": 0, "time_s": 1.0, "accuracy": 0.9, "test_samples": 50})
    writer.write("end", 10, 1, 1.1)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/world_size", "eval/accuracy"} <= set(
        events.Tags()["scalars"]
    )
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/lr")] == [(5, 0.005), (10, 0.01)]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [10]
    assert {"events/start/text_summary", "events/end/text_summary"} <= set(events.Tags()["tensors"])


def test_only_rank_0_and_only_when_asked(tmp_path: Path) -> None:
    assert tb.open_for(config.load(None, ["log.tensorboard=true"]), tmp_path, rank=1) is None
    assert tb.open_for(config.load(), tmp_path, rank=0) is None
    assert not (tmp_path / "tensorboard").exists()


def test_require_names_the_extra_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config.load(None, ["log.tensorboard=true"])
    tb.require(cfg)  # installed here: no error
    # Without the package (hidden from the import system, as on a plain install):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'ddp_slurm\[tensorboard\]'"):
        tb.require(cfg)
    tb.require(config.load())  # off: never asks
