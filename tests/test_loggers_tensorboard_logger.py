"""TensorBoard events from the records metrics.jsonl gets, read back with TensorBoard's own reader
(ddp_slurm/train/loggers/tensorboard_logger.py), and the two calls training makes (loggers.require,
loggers.open_sinks) for it."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest
from conftest import skip_or_fail

from ddp_slurm import config
from ddp_slurm.config import ConfigError
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train import loggers
from ddp_slurm.train.loggers import boundary
from ddp_slurm.train.loggers.tensorboard_logger import TensorBoardSink


@pytest.fixture(autouse=True)
def _tensorboard_installed() -> None:
    if importlib.util.find_spec("tensorboard") is None:  # the test extra installs it
        skip_or_fail("tensorboard is not installed: pip install -e '.[test]'")


def tensorboard_config(tmp_path: Path) -> config.Config:
    return config.load(None, ["log.tensorboard=true", f"run.output_root={tmp_path}", "run.name=tb"])


def test_records_become_scalars_and_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardSink(RunPaths(tmp_path))
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


def test_open_sinks_opens_it_on_rank_0_only_and_only_when_asked(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tensorboard_config(tmp_path)
    assert loggers.open_sinks(cfg, rank=1) == []
    assert loggers.open_sinks(config.load(None, [f"run.output_root={tmp_path}", "run.name=tb"]), rank=0) == []
    assert not cfg.paths.tensorboard.exists()
    (sink,) = loggers.open_sinks(cfg, rank=0)
    assert sink.key == "log.tensorboard"
    sink.write("train", 4, 0, 0.4, loss=0.25)
    boundary.close_all([sink])  # the backlog is written before close returns
    events = EventAccumulator(str(cfg.paths.tensorboard))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(4, 0.25)]


def test_a_folder_with_a_planted_link_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A symlink at ``tensorboard`` or inside it (TensorBoard writes with a plain open): the logger is off
    with one warning, the victim's files untouched."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "events.out.tfevents.1").write_bytes(b"theirs")
    for plant in ("folder", "inside"):
        cfg = config.load(None, ["log.tensorboard=true", f"run.output_root={tmp_path}", f"run.name={plant}"])
        cfg.paths.root.mkdir()
        if plant == "folder":
            cfg.paths.tensorboard.symlink_to(victim)
        else:
            (cfg.paths.tensorboard / "old").mkdir(parents=True)
            (cfg.paths.tensorboard / "old" / "link").symlink_to(victim)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ddp_slurm"):
            (sink,) = loggers.open_sinks(cfg, rank=0)
            sink.write("train", 4, 0, 0.4, loss=0.25)
            boundary.close_all([sink])
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "log.tensorboard: could not start (UnsafePath" in warnings[0] and "symlink" in warnings[0], warnings
        assert os.listdir(victim) == ["events.out.tfevents.1"]
        assert (victim / "events.out.tfevents.1").read_bytes() == b"theirs"


def test_require_names_the_extra_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config.load(None, ["log.tensorboard=true"])
    loggers.require(cfg)  # installed here: no error
    # Without the package (hidden from the import system, as on a plain install):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'ddp_slurm\[tensorboard\]'"):
        loggers.require(cfg)
    loggers.require(config.load())  # off: never asks
