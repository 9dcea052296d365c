"""A run directory on a file system other users share: what a co-tenant or a careless copy can plant
there must not delete checkpoints, be resumed from, or be written through.

Real files, real symlinks, FIFOs and owners (``chown`` to another uid needs root; without it those
tests skip, or fail under CI).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

import pytest
import torch
from conftest import skip_or_fail
from test_checkpoint import make_state

from ddp_slurm import config, safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.tasks.mnist import models
from ddp_slurm.train import checkpoint
from ddp_slurm.train.metrics import MetricsWriter
from ddp_slurm.train.rundir import RunLock

OTHER_UID = 65534  # nobody


def needs_root() -> None:
    if os.geteuid() != 0:
        skip_or_fail("giving a file to another user needs root")


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in checkpoint.checkpoint_dir(run_dir).iterdir())


@pytest.fixture
def umask_002():
    """The umask of a group project area: without explicit modes, files would be group-writable."""
    old = os.umask(0o002)
    yield
    os.umask(old)


# --------------------------------------------------------------------------- 1. pruning
def test_junk_with_huge_step_names_does_not_get_new_checkpoints_pruned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = checkpoint.checkpoint_dir(tmp_path)
    folder.mkdir(parents=True)
    junk = {
        "step-999999999.pt": b"not a checkpoint",  # another tool's file
        "step-999999998.pt": b"PK\x03\x04" + b"\0" * 100,  # a half-finished rsync of a zip
    }
    for name, data in junk.items():
        (folder / name).write_bytes(data)
    torch.save({"weights": torch.zeros(2)}, folder / "step-999999997.pt")  # loads, but is not ours
    state = make_state(step=0)
    with caplog.at_level(logging.WARNING):
        for step in (10, 20, 30):
            checkpoint.save(tmp_path, dict(state, step=step), keep=2)
    assert names(tmp_path) == sorted([*junk, "step-999999997.pt", "step-20.pt", "step-30.pt"])
    for name, data in junk.items():
        assert (folder / name).read_bytes() == data  # never deleted
    assert "leaving" in caplog.text and "step-999999999.pt" in caplog.text
    path, found = checkpoint.latest(tmp_path)
    assert found["step"] == 30 and path.name == "step-30.pt"


def test_a_checkpoint_whose_name_lies_about_its_step_is_neither_counted_nor_resumed(tmp_path: Path) -> None:
    state = make_state(step=0)
    real = checkpoint.save(tmp_path, dict(state, step=10), keep=5)
    renamed = real.with_name("step-500.pt")  # a valid file copied under another step's name
    renamed.write_bytes(real.read_bytes())
    checkpoint.save(tmp_path, dict(state, step=20), keep=1)
    assert names(tmp_path) == ["step-20.pt", "step-500.pt"]  # 10 pruned (keep=1), 500 left alone
    path, found = checkpoint.latest(tmp_path)
    assert path.name == "step-20.pt" and found["step"] == 20


def test_another_runs_valid_checkpoint_is_neither_counted_nor_pruned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A valid checkpoint of another run (another config, a higher step), copied in: resume refuses it, so
    pruning must not count it either (with checkpoint.keep=2 it used to cost this run a real checkpoint)."""
    state = make_state(step=0)
    other = config.Config()
    other.train.lr = 0.5
    checkpoint.save(tmp_path, dict(state, step=999, config=other.to_dict()), keep=5)
    cnn = dict(state, step=998, model=models.build("cnn").state_dict())  # another model, same config
    checkpoint.save(tmp_path, cnn, keep=5)
    with caplog.at_level(logging.WARNING):
        for step in (10, 20, 30):
            checkpoint.save(tmp_path, dict(state, step=step), keep=2)
    assert names(tmp_path) == ["step-20.pt", "step-30.pt", "step-998.pt", "step-999.pt"]
    assert "step-999.pt alone (not counted for checkpoint.keep): written by a run with another config" in caplog.text
    assert "step-998.pt alone (not counted for checkpoint.keep): it holds another model" in caplog.text
    cfg = config.Config()
    accept = checkpoint.all_of(checkpoint.same_config(cfg), checkpoint.same_model(state["model"]))
    assert checkpoint.latest(tmp_path, accept=accept)[1]["step"] == 30


# --------------------------------------------------------------------------- 2. foreign checkpoints
def test_checkpoint_of_another_config_falls_back_to_the_previous_valid_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config.Config(run=config.RunConfig(name="r"))
    state = make_state(step=0)  # its "config" is config.Config().to_dict()
    checkpoint.save(tmp_path, dict(state, step=10), keep=5)
    other = config.Config()
    other.train.lr = 0.5
    checkpoint.save(tmp_path, dict(state, step=20, config=other.to_dict()), keep=5)
    with caplog.at_level(logging.WARNING):
        path, found = checkpoint.latest(tmp_path, accept=checkpoint.same_config(cfg))
    assert found["step"] == 10
    assert "step-20.pt" in caplog.text and "train.lr: 0.5 -> 0.004" in caplog.text
    # a key that may change between launches (checkpoint.*, dist.*, ...) does not make it foreign
    cfg.checkpoint.keep = 9
    assert checkpoint.latest(tmp_path, accept=checkpoint.same_config(other))[1]["step"] == 20


def test_checkpoint_of_another_model_or_missing_entries_falls_back(tmp_path: Path) -> None:
    state = make_state(step=0)
    checkpoint.save(tmp_path, dict(state, step=10), keep=5)
    cnn = models.build("cnn").state_dict()
    checkpoint.save(tmp_path, dict(state, step=20, model=cnn), keep=5)
    checkpoint.save(tmp_path, {k: v for k, v in dict(state, step=30).items() if k != "optimizer"}, keep=5)
    checkpoint.save(tmp_path, {k: v for k, v in dict(state, step=40).items() if k != "rng"}, keep=5)
    accept = checkpoint.all_of(checkpoint.require("optimizer", "rng"), checkpoint.same_model(state["model"]))
    assert checkpoint.latest(tmp_path)[1]["step"] == 40  # without the run's judgement: the newest
    assert checkpoint.latest(tmp_path, accept=accept)[1]["step"] == 10
    with pytest.raises(ValueError, match="another model"):
        checkpoint.same_model(state["model"])(dict(state, model=cnn))
    with pytest.raises(ValueError, match="'rng'"):
        checkpoint.require("rng")({"model": {}})


def test_when_no_checkpoint_is_accepted_the_run_refuses_to_start_over(tmp_path: Path) -> None:
    state = make_state(step=0)
    other = config.Config()
    other.model.name = "mlp"
    checkpoint.save(tmp_path, dict(state, step=10), keep=5)
    with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint"):
        checkpoint.latest(tmp_path, accept=checkpoint.same_config(other))


# --------------------------------------------------------------------------- 3. owners and modes
def test_files_and_directories_get_private_modes_whatever_the_umask(tmp_path: Path, umask_002) -> None:
    cfg = config.Config()
    cfg.run.output_root, cfg.run.name = str(tmp_path), "modes"
    safefs.make_dir(cfg.run_dir)
    checkpoint.save(cfg.run_dir, make_state(step=10), keep=2)
    config.dump(cfg, cfg.run_dir / "config.yaml")
    MetricsWriter(cfg.run_dir / "metrics.jsonl").close()
    lock = RunLock(cfg.paths)
    lock.acquire()
    lock.release()
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(cfg.run_dir) == 0o750 and mode(checkpoint.checkpoint_dir(cfg.run_dir)) == 0o750
    for name in ("config.yaml", "metrics.jsonl", ".lock", "checkpoints/step-10.pt"):
        assert mode(cfg.run_dir / name) == 0o640, name
    safefs.check_run_dir(cfg.run_dir)
    assert checkpoint.latest(cfg.run_dir)[1]["step"] == 10


def test_shared_run_is_group_writable(tmp_path: Path, umask_002) -> None:
    run_dir = tmp_path / "team"
    safefs.make_dir(run_dir, shared=True)
    checkpoint.save(run_dir, make_state(step=10), keep=2, shared=True)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o770
    assert stat.S_IMODE((run_dir / "checkpoints" / "step-10.pt").stat().st_mode) == 0o660
    with pytest.raises(checkpoint.CheckpointError, match="writable by the group.*run.shared=true"):
        checkpoint.latest(run_dir)
    assert checkpoint.latest(run_dir, shared=True)[1]["step"] == 10


def test_shared_run_gets_team_modes_under_the_common_umask_022(tmp_path: Path) -> None:
    """umask 022 (most login shells) strips the group's write bit: a team run's directories and files are
    set 0770/0660 explicitly, or teammates could not resume it."""
    old = os.umask(0o022)
    try:
        cfg = config.Config()
        cfg.run.output_root, cfg.run.name, cfg.run.shared = str(tmp_path), "team", True
        safefs.make_dir(cfg.run_dir, shared=True)
        checkpoint.save(cfg.run_dir, make_state(step=10), keep=2, shared=True)
        config.dump(cfg, cfg.run_dir / "config.yaml")
        MetricsWriter(cfg.run_dir / "metrics.jsonl", shared=True).close()
        lock = RunLock(cfg.paths)
        lock.acquire()
        lock.release()
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(cfg.run_dir) == 0o770 and mode(checkpoint.checkpoint_dir(cfg.run_dir)) == 0o770
    for name in ("config.yaml", "metrics.jsonl", ".lock", "checkpoints/step-10.pt"):
        assert mode(cfg.run_dir / name) == 0o660, name


REFUSED = (safefs.UnsafePath, checkpoint.CheckpointError)


def resume_checks(run_dir: Path, shared: bool = False) -> None:
    """What a resume checks, in the loop's order: the run directory, then the checkpoints."""
    safefs.check_run_dir(run_dir, shared)
    checkpoint.latest(run_dir, shared=shared)


@pytest.mark.parametrize("what", ["run_dir", "config.yaml", "checkpoints", "step"])
def test_group_or_world_writable_is_refused_for_resume_naming_the_file_and_the_fix(tmp_path: Path, what: str) -> None:
    run_dir = tmp_path / "run"
    safefs.make_dir(run_dir)
    path = checkpoint.save(run_dir, make_state(step=10), keep=2)
    config.dump(config.Config(), run_dir / "config.yaml")
    target = {"run_dir": run_dir, "config.yaml": run_dir / "config.yaml", "checkpoints": path.parent}.get(what, path)
    target.chmod(stat.S_IMODE(target.stat().st_mode) | 0o020)
    with pytest.raises(REFUSED) as err:
        resume_checks(run_dir)
    assert str(target) in str(err.value) and f"chmod go-w {target}" in str(err.value)
    assert "run.shared=true" in str(err.value)
    resume_checks(run_dir, shared=True)  # a team run trusts the group
    target.chmod(stat.S_IMODE(target.stat().st_mode) | 0o002)  # every user: refused even for a team run
    with pytest.raises(REFUSED, match="writable by every user"):
        resume_checks(run_dir, shared=True)


def test_checkpoint_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    needs_root()
    state = make_state(step=0)
    checkpoint.save(tmp_path, dict(state, step=10), keep=5)
    planted = checkpoint.save(tmp_path, dict(state, step=10**9, finished=True), keep=5)  # "finished at 10^9"
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(checkpoint.CheckpointError, match=f"{planted}: owned by uid {OTHER_UID}, not by you"):
        checkpoint.latest(tmp_path)
    os.chown(tmp_path, OTHER_UID, OTHER_UID)
    with pytest.raises(safefs.UnsafePath, match=f"refusing to resume from {tmp_path}: owned by uid"):
        safefs.check_run_dir(tmp_path)


def test_resuming_a_teammates_checkpoint_names_its_owner(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A team run resumes a checkpoint a teammate wrote (its group is one of ours): the log says whose."""
    needs_root()
    state = make_state(step=0)
    theirs = checkpoint.save(tmp_path, dict(state, step=10), keep=5, shared=True)
    os.chown(theirs, OTHER_UID, os.getegid())
    with caplog.at_level(logging.WARNING):
        path, _ = checkpoint.latest(tmp_path, shared=True)
    assert path == theirs
    assert re.search(rf"resuming from \S*step-10\.pt, written by \S+ \(uid {OTHER_UID}\), not by you", caplog.text)


# --------------------------------------------------------------------------- 3. no write follows a link
def test_planted_symlinks_are_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file\n")
    run_dir = tmp_path / "run"
    safefs.make_dir(run_dir)
    (run_dir / ".lock").symlink_to(victim)
    with pytest.raises(safefs.UnsafePath, match="is a symlink"):
        RunLock(RunPaths(run_dir)).acquire()
    (run_dir / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(safefs.UnsafePath, match="is a symlink"):
        MetricsWriter(run_dir / "metrics.jsonl")
    (run_dir / "config.yaml").symlink_to(victim)
    config.dump(config.Config(), run_dir / "config.yaml")  # the link is replaced, not followed
    assert not (run_dir / "config.yaml").is_symlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(checkpoint.CheckpointError, match="is a symlink, not a directory"):
        checkpoint.save(run_dir, make_state(step=10), keep=2)
    assert victim.read_text() == "another user's file\n" and list(elsewhere.iterdir()) == []


def test_planted_fifo_or_foreign_file_is_refused_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(safefs.UnsafePath, match="FIFO"):
        MetricsWriter(tmp_path / "metrics.jsonl")
    needs_root()
    (tmp_path / ".lock").write_text("")
    os.chown(tmp_path / ".lock", OTHER_UID, OTHER_UID)
    with pytest.raises(safefs.UnsafePath, match=f"belongs to uid {OTHER_UID}"):
        RunLock(RunPaths(tmp_path)).acquire()


def test_temporary_names_cannot_be_planted_in_advance(tmp_path: Path) -> None:
    final = tmp_path / "step-10.pt"
    first, second = safefs.temp_name(final), safefs.temp_name(final)
    assert first != second and first.name.startswith(".step-10.pt.tmp-")
    first.symlink_to(tmp_path / "victim")  # even a guessed one: O_EXCL refuses an existing name
    with pytest.raises(FileExistsError):
        safefs.open_new(first)
    assert not (tmp_path / "victim").exists()


# --------------------------------------------------------------------------- 6. the run's own config.yaml
@pytest.mark.parametrize("content", [b"", b"- 1\n", b"3\n", b"\xff\xfe", b"train:\n  epochs: -1\n", None])
def test_damaged_run_directory_config_is_one_config_error_naming_it(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "config.yaml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(config.ConfigError) as err:
        config.read_resolved(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "move the run directory away" in message


def test_dump_is_durable_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    cfg = config.Config(run=config.RunConfig(name="r"))
    config.dump(cfg, tmp_path / "config.yaml")
    config.dump(cfg, tmp_path / "config.yaml")  # over an existing one
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]
    assert config.read_resolved(tmp_path / "config.yaml") == cfg


# --------------------------------------------------------------------------- 4. result pickles
class _Planted:
    """What a co-tenant would write as a result file: unpickling it runs code (creates a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("loose", ["folder", "file"])
def test_result_file_others_could_write_is_not_unpickled(tmp_path: Path, loose: str) -> None:
    import pickle
    from types import SimpleNamespace

    from ddp_slurm.launch.follow import task_results

    folder = tmp_path / "submitit" / "42"
    folder.mkdir(parents=True, mode=0o750)
    result = folder / "42_0_result.pkl"
    marker = tmp_path / "code-ran"
    result.write_bytes(pickle.dumps(("success", _Planted(marker))))
    result.chmod(0o640)
    job = SimpleNamespace(num_tasks=1, task=lambda i: SimpleNamespace(paths=SimpleNamespace(result_pickle=result)))
    target = folder if loose == "folder" else result
    target.chmod(stat.S_IMODE(target.stat().st_mode) | 0o020)
    assert task_results(job) == [None] and not marker.exists()
    target.chmod(stat.S_IMODE(target.stat().st_mode) & ~0o020)
    task_results(job)  # now trusted (this user's, not writable by others): read as before
    assert marker.exists()
