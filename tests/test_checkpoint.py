"""Checkpoint files on their own: atomic save, pruning, safe loading, and every way a file can be unusable.

The damaged files are made the way they happen in practice (a write cut short, a flipped bit in the
tensor data, an empty file, somebody else's pickle) and ``latest`` must skip each one with a warning
that names it, falling back to the newest checkpoint that is intact.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import helpers
import pytest
import torch
import torch.distributed as dist

from ddp_slurm import config
from ddp_slurm.bootstrap import DistEnv
from ddp_slurm.tasks.mnist import models
from ddp_slurm.train import checkpoint
from ddp_slurm.train.checkpoint import state as state_mod
from ddp_slurm.train.checkpoint.backends import WholeFile
from ddp_slurm.train.optim import make_optimizer, make_scheduler


def make_state(step: int, seed: int = 0) -> dict[str, Any]:
    """A checkpoint as the training loop writes one: a real model, optimizer and scheduler after a step."""
    torch.manual_seed(seed)
    model = models.build("mlp")
    cfg = config.Config()
    optimizer = make_optimizer(cfg.train, model.parameters(), torch.device("cpu"))
    scheduler = make_scheduler(cfg.train, optimizer, total_steps=100)
    model(torch.randn(8, 1, 28, 28)).sum().backward()
    optimizer.step()
    scheduler.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
        "epoch": 0,
        "step_in_epoch": step,
        "finished": False,
        "rng": {"torch": torch.get_rng_state()},
        "config": cfg.to_dict(),
    }


def assert_same_tensors(a: Any, b: Any) -> None:
    found_a, found_b = dict(checkpoint._tensors(a)), dict(checkpoint._tensors(b))
    assert found_a.keys() == found_b.keys()
    for name, t in found_a.items():
        assert torch.equal(t, found_b[name]), name


def tensor_data_offset(path: Path, entry: str) -> tuple[int, int]:
    """(offset, size) of one zip entry's stored bytes inside a torch.save file."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(entry)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    assert header[:4] == b"PK\x03\x04" and info.compress_type == zipfile.ZIP_STORED
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def largest_entry(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        return max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size).filename


def test_roundtrip_keeps_every_tensor_and_field(tmp_path: Path) -> None:
    state = make_state(step=30)
    path = checkpoint.save(tmp_path, state, keep=3)
    assert path == tmp_path / "checkpoints" / "step-30.pt"
    loaded = checkpoint.load(path)
    assert_same_tensors(state, {k: v for k, v in loaded.items() if k in state})
    assert (loaded["step"], loaded["epoch"], loaded["step_in_epoch"], loaded["finished"]) == (30, 0, 30, False)
    assert loaded["format"] == checkpoint.FORMAT == 4 and "content_sha256" not in loaded
    assert loaded["config"] == state["config"]
    # What was restored drives a model and an optimizer exactly like the originals.
    model = models.build("mlp")
    model.load_state_dict(loaded["model"])
    optimizer = make_optimizer(config.Config().train, model.parameters(), torch.device("cpu"))
    optimizer.load_state_dict(loaded["optimizer"])
    assert checkpoint.load_latest(tmp_path)["step"] == 30
    assert not list((tmp_path / "checkpoints").glob(".*")), "temporary file left behind"


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    state = make_state(step=0)
    for step in (10, 20, 30, 40, 50, 60):
        checkpoint.save(tmp_path, dict(state, step=step), keep=3)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [60, 50, 40]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-40.pt", "step-50.pt", "step-60.pt"]
    # Steps sort as numbers, not as text (step-100 is newer than step-60).
    checkpoint.save(tmp_path, dict(state, step=100), keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [100, 60]


def test_prune_with_memory_reads_only_files_it_did_not_write_once_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer keeps pruning's verdicts across saves (``seen``): a checkpoint it wrote itself is never
    read back; a file that came another way (junk, a file replaced under a kept name) is judged once."""
    from ddp_slurm.train.checkpoint import listing

    reads: list[str] = []
    summary = listing.summary
    monkeypatch.setattr(listing, "summary", lambda path: reads.append(path.name) or summary(path))
    state, seen = make_state(step=0), {}
    for step in (10, 20, 30, 40, 50):
        checkpoint.save(tmp_path, dict(state, step=step), keep=3, seen=seen)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [50, 40, 30]
    assert reads == []
    # A junk file under a checkpoint's name: judged once, left alone with one warning, never counted.
    junk = tmp_path / "checkpoints" / "step-999.pt"
    junk.write_bytes(b"not a checkpoint")
    for step in (60, 70):
        checkpoint.save(tmp_path, dict(state, step=step), keep=3, seen=seen)
    assert reads == ["step-999.pt"]
    assert caplog.text.count("leaving") == 1 and "step-999.pt" in caplog.text
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [999, 70, 60, 50]
    # Another file under a kept name (another identity): judged as the stranger it is.
    other = checkpoint.save(tmp_path / "other", dict(make_state(step=0, seed=1), step=60), keep=3)
    os.replace(other, tmp_path / "checkpoints" / "step-60.pt")
    checkpoint.save(tmp_path, dict(state, step=80), keep=3, seen=seen)
    assert reads == ["step-999.pt", "step-60.pt"]
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [999, 80, 70, 60]
    # Without memory (a caller that keeps none) every kept file is judged again: the verdicts agree.
    checkpoint.save(tmp_path, dict(state, step=90), keep=3)
    assert sorted(reads[2:]) == ["step-60.pt", "step-70.pt", "step-80.pt", "step-999.pt"]
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [999, 90, 80, 70]


def test_saved_model_has_no_ddp_prefix(tmp_path: Path) -> None:
    """The training loop's state capture, given a real DDP-wrapped model: keys load into a bare model, strictly."""
    cfg = config.load(None, [f"run.output_root={tmp_path}", "run.name=prefix", "model.name=cnn"])
    env = DistEnv.from_environ({})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = models.build("cnn")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        assert all(k.startswith("module.") for k in ddp.state_dict())
        optimizer = make_optimizer(cfg.train, ddp.parameters(), torch.device("cpu"))
        scheduler = make_scheduler(cfg.train, optimizer, 10)
        ddp(torch.randn(4, 1, 28, 28)).sum().backward()
        optimizer.step()
        run = helpers.run_objects(model, optimizer, scheduler, state_mod.Position(step=7), env.rank, env.world_size)
        snapshot = WholeFile().capture(run, False, 1.0, {"config": cfg.to_dict()})
        checkpoint.save(cfg.run_dir, snapshot, keep=cfg.checkpoint.keep)
    finally:
        dist.destroy_process_group()
    state = checkpoint.load_latest(cfg.run_dir)
    assert state is not None and state["step"] == 7
    assert not [k for k in state["model"] if k.startswith("module.")]
    fresh = models.build("cnn")
    fresh.load_state_dict(state["model"], strict=True)  # BatchNorm buffers included
    assert_same_tensors(fresh.state_dict(), model.state_dict())


class RunsCode:
    """Unpickling this runs a shell command: what a tampered checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_with_code_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = checkpoint.save(tmp_path, make_state(step=10), keep=5)
    marker = tmp_path / "code-ran"
    evil = dict(checkpoint.load(good), step=20, model={"weight": RunsCode(marker)})
    bad = tmp_path / "checkpoints" / "step-20.pt"
    torch.save(evil, bad)
    with pytest.raises(ValueError, match="unreadable"):
        checkpoint.load(bad)
    with caplog.at_level(logging.WARNING, logger="ddp_slurm.train.checkpoint"):
        path, state = checkpoint.latest(tmp_path)
    assert path == good and state["step"] == 10
    assert "step-20.pt" in caplog.text
    assert not marker.exists(), "loading a checkpoint ran code"


def damage_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def damage_flip_bit_in_tensor_data(path: Path) -> None:
    offset, size = tensor_data_offset(path, largest_entry(path))
    with open(path, "r+b") as f:
        f.seek(offset + size // 2)
        byte = f.read(1)[0]
        f.seek(offset + size // 2)
        f.write(bytes([byte ^ 0x04]))  # a low mantissa bit: still a finite float, only the digest can tell


def damage_empty(path: Path) -> None:
    path.write_bytes(b"")


def damage_not_a_checkpoint(path: Path) -> None:
    torch.save({"weights": torch.zeros(3), "note": "some other program's file"}, path)


DAMAGES = {
    "truncated": damage_truncate,
    "bit-flip": damage_flip_bit_in_tensor_data,
    "empty": damage_empty,
    "not-a-checkpoint": damage_not_a_checkpoint,
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_unusable_newest_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    state = make_state(step=0)
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, dict(state, step=step), keep=5)
    newest = tmp_path / "checkpoints" / "step-30.pt"
    DAMAGES[damage](newest)
    with pytest.raises(ValueError):
        checkpoint.load(newest)
    with caplog.at_level(logging.WARNING, logger="ddp_slurm.train.checkpoint"):
        path, loaded = checkpoint.latest(tmp_path)
        via_contract = checkpoint.load_latest(tmp_path)
    assert path.name == "step-20.pt" and loaded["step"] == 20 and via_contract["step"] == 20
    skipped = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert skipped and all(str(newest) in r.getMessage() for r in skipped), caplog.text
    assert_same_tensors(loaded["model"], state["model"])


def test_bit_flip_is_caught_by_the_digest(tmp_path: Path) -> None:
    """The zip container reads a flipped bit inside tensor data without complaint; the seal does not."""
    path = checkpoint.save(tmp_path, make_state(step=10), keep=5)
    damage_flip_bit_in_tensor_data(path)
    torch.load(path, map_location="cpu", weights_only=True)  # still a perfectly readable file
    with pytest.raises(ValueError, match="digest mismatch"):
        checkpoint.load(path)


def test_all_unusable_raises_naming_them(tmp_path: Path) -> None:
    state = make_state(step=0)
    for step in (10, 20):
        checkpoint.save(tmp_path, dict(state, step=step), keep=5)
    damage_truncate(tmp_path / "checkpoints" / "step-20.pt")
    damage_empty(tmp_path / "checkpoints" / "step-10.pt")
    with pytest.raises(checkpoint.CheckpointError, match=r"step-20\.pt, step-10\.pt") as info:
        checkpoint.load_latest(tmp_path)
    assert str(tmp_path / "checkpoints") in str(info.value) and "\n" not in str(info.value)


def test_no_checkpoints_is_none(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "notes.txt").write_text("not a checkpoint name")
    assert checkpoint.load_latest(tmp_path) is None


def test_stale_temporaries_are_removed_and_never_loaded(tmp_path: Path) -> None:
    good = checkpoint.save(tmp_path, make_state(step=10), keep=5)
    folder = tmp_path / "checkpoints"
    stale = [folder / ".step-20.pt.tmp-4242", folder / ".step-10.pt.tmp-17"]
    for p in stale:
        p.write_bytes(good.read_bytes()[:1000])
    other = folder / "README"
    other.write_text("kept")
    assert [p for _, p in checkpoint.list_checkpoints(tmp_path)] == [good]
    checkpoint.remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["README", "step-10.pt"]
    checkpoint.remove_stale_temporaries(tmp_path / "no-such-run")  # nothing there: no error


WRITE_UNDER_FILE_SIZE_LIMIT = """
import resource, sys
from pathlib import Path
import torch
from ddp_slurm.train import checkpoint
run_dir = Path(sys.argv[1])
state = checkpoint.load_latest(run_dir)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # writes past 100 kB fail with EFBIG
try:
    checkpoint.save(run_dir, dict(state, step=20), keep=1)
except checkpoint.CheckpointError as exc:
    print(exc)
    sys.exit(0)
sys.exit("the save did not fail")
"""


def test_failed_write_keeps_previous_and_leaves_no_temporary(tmp_path: Path) -> None:
    """A write that fails half way (a real EFBIG, like a full disk): one-line error naming the file,
    the previous checkpoint intact and still the latest, no temporary file left, nothing pruned."""
    good = checkpoint.save(tmp_path, make_state(step=10), keep=1)
    assert good.stat().st_size > 100_000
    res = subprocess.run(
        [sys.executable, "-c", WRITE_UNDER_FILE_SIZE_LIMIT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    message = res.stdout.strip()
    assert "step-20.pt" in message and "previous checkpoints are intact" in message and "\n" not in message
    assert [p for _, p in checkpoint.list_checkpoints(tmp_path)] == [good]
    assert checkpoint.load_latest(tmp_path)["step"] == 10
    assert not list((tmp_path / "checkpoints").glob(".*")), "temporary file left behind"


def test_unserialisable_state_leaves_no_temporary(tmp_path: Path) -> None:
    """A programming error (something pickle cannot write) propagates, but never leaves half a file."""
    good = checkpoint.save(tmp_path, make_state(step=10), keep=1)
    with pytest.raises(Exception, match="pickle"):
        checkpoint.save(tmp_path, dict(make_state(step=20), extra=lambda: None), keep=1)
    assert [p for _, p in checkpoint.list_checkpoints(tmp_path)] == [good]
    assert not list((tmp_path / "checkpoints").glob(".*")), "temporary file left behind"
