"""Sharded checkpoints on disk (``train/checkpoint/sharded.py``, through the gate): what counts as a
checkpoint, verified on load, pruned by what passes. One real 1-rank fsdp run writes them; each test works
on a copy."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import base_env

from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train import checkpoint
from ddp_slurm.train.checkpoint import gate, listing, sharded
from ddp_slurm.train.checkpoint.backends import Sharded


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished fsdp run with checkpoints at steps 10, 20, 30, written synchronously (checkpoint.async=false;
    the background path is tests/test_fsdp.py's)."""
    cwd = tmp_path_factory.mktemp("sharded")
    overrides = ["dist.strategy=fsdp", "model.name=mlp", "train.max_steps=30", "checkpoint.every_steps=10"]
    overrides += ["checkpoint.async=false"]
    res = subprocess.run(
        [sys.executable, "-m", "ddp_slurm.train", *overrides, "checkpoint.keep=10", "run.name=r"],
        cwd=cwd, env=base_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return cwd / "runs" / "r"


@pytest.fixture
def run(written: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(written, tmp_path / "r"))


def flip(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_newest_committed_checkpoint_is_found_and_holds_the_whole_state(run: Path) -> None:
    assert [s for s, _ in sharded.list_sharded(RunPaths(run))] == [30, 20, 10]
    folder, record = checkpoint.latest(run)
    assert folder.name == "step-30" and record["step"] == 30 and record["finished"] and len(record["rng"]) == 1
    state = checkpoint.load_latest(run)  # gathered into one state, without a process group
    assert state["step"] == 30 and state["model"]["1.weight"].shape == torch.Size([100, 784])
    assert {"exp_avg", "exp_avg_sq", "step"} <= state["optimizer"]["state"]["1.weight"].keys()
    for path in [folder, *folder.iterdir()]:  # the run's modes (run.shared=false), not the umask's
        assert path.stat().st_mode & 0o777 == (0o750 if path.is_dir() else 0o640), path


@pytest.mark.parametrize("damage", ["shard", "metadata", "commit", "missing"])
def test_a_damaged_checkpoint_is_skipped_for_the_one_before(
    run: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    newest = run / "checkpoints" / "step-30"
    if damage == "shard":
        flip(newest / "__0_0.distcp")
    elif damage == "metadata":
        flip(newest / ".metadata", 10)
    elif damage == "commit":
        flip(newest / "commit.pt", 200)
    else:
        (newest / "__0_0.distcp").unlink()
    with caplog.at_level(logging.WARNING):
        folder, record = checkpoint.latest(run)
    assert folder.name == "step-20" and record["step"] == 20
    assert f"skipping checkpoint {newest}" in caplog.text


def test_a_folder_without_its_commit_record_is_no_checkpoint(run: Path) -> None:
    """A folder renamed into place by hand, or somebody's empty ``step-N``: not a candidate at all."""
    (run / "checkpoints" / "step-30" / "commit.pt").unlink()
    (run / "checkpoints" / "step-99").mkdir()
    assert [s for s, _ in sharded.list_sharded(RunPaths(run))] == [20, 10]
    assert checkpoint.latest(run)[0].name == "step-20"


def test_no_usable_checkpoint_among_several_is_an_error(run: Path) -> None:
    for _, folder in sharded.list_sharded(RunPaths(run)):
        flip(folder / "__0_0.distcp")
    with pytest.raises(checkpoint.CheckpointError, match="refusing to start over"):
        checkpoint.latest(run)


def test_pruning_counts_only_committed_checkpoints(run: Path) -> None:
    folder, paths = run / "checkpoints", RunPaths(run)
    (folder / "step-99").mkdir()  # not a checkpoint: no commit record; left alone, not counted
    backend = Sharded()
    judge = gate.Gate(backend, paths, []).judge_summary
    listing.prune(
        backend.candidates(paths), 1, folder / "step-30", summary_of=backend.summary, judge=judge, remove=sharded.remove
    )
    assert sorted(p.name for p in folder.iterdir()) == ["step-30", "step-99"]


def test_partial_writes_are_cleared_and_never_count(run: Path) -> None:
    partial = RunPaths(run).partial(40)
    shutil.copytree(run / "checkpoints" / "step-30", partial)
    assert checkpoint.latest(run)[0].name == "step-30"
    sharded.remove_stale_partials(RunPaths(run))
    assert not partial.exists()


@pytest.mark.parametrize("available_mib", [1, None], ids=["too-little", "plenty"])
def test_async_sharded_saves_turn_synchronous_when_host_copies_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, available_mib: int | None
) -> None:
    """``checkpoint.async`` copies every shard into host memory (pinned on a GPU): where that copy would
    take more than half the host's available memory, the run saves synchronously, says so once, and the
    checkpoints are whole all the same. A host's MemAvailable cannot be made small here: its reading is
    replaced (the one stand-in of this file)."""
    import torch.distributed as dist

    from ddp_slurm.train import fsdp
    from ddp_slurm.train.checkpoint import sharded_writer

    if available_mib is not None:
        monkeypatch.setattr(sharded_writer, "available_memory", lambda: available_mib * 2**20)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = fsdp.shard(torch.nn.Sequential(torch.nn.Linear(512, 1024)), [], torch.device("cpu"), "fp32")
        paths = RunPaths(tmp_path / "r")
        paths.root.mkdir()
        ckpt = sharded_writer.ShardedCheckpointer(paths, True)
        with caplog.at_level(logging.WARNING, logger="ddp_slurm"):
            returned = [ckpt.save(({"model": model.state_dict()}, {"step": step})) for step in (1, 2)]
        ckpt.close()
    finally:
        dist.destroy_process_group()
    warned = [r.getMessage() for r in caplog.records if "saving synchronously" in r.getMessage()]
    if available_mib is not None:  # 2 MiB of shards against 1 MiB available
        assert returned == [paths.sharded(1), paths.sharded(2)] and len(warned) == 1, warned
        assert "(2 MiB on this rank)" in warned[0] and "this one: 1 MiB" in warned[0]
    else:
        assert returned == [None, None] and not warned
    assert [step for step, _ in sharded.list_sharded(paths)] == [2, 1]


def test_pruning_spares_the_best_beside_the_newest(run: Path) -> None:
    """``checkpoint.keep=1`` with the best older than the newest: both stay, nothing else."""
    folder, paths = run / "checkpoints", RunPaths(run)
    steps = sorted(int(p.name.split("-")[1]) for p in folder.iterdir())
    assert len(steps) >= 2, steps
    backend = Sharded()
    judge = gate.Gate(backend, paths, []).judge_summary
    newest, best = folder / f"step-{steps[-1]}", folder / f"step-{steps[0]}"
    listing.prune(
        backend.candidates(paths),
        1,
        newest,
        summary_of=backend.summary,
        judge=judge,
        remove=sharded.remove,
        spare=[best],
    )
    assert sorted(p.name for p in folder.iterdir()) == sorted({newest.name, best.name})
