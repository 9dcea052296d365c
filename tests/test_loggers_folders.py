"""A folder a library writes into (MLflow's file store, TensorBoard's events) is the run's own, with no
link inside, or refused (ddp_slurm/train/loggers/folders.py). Real files, links and FIFOs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ddp_slurm.safefs import UnsafePath
from ddp_slurm.train.loggers.folders import library_folder


def test_a_missing_folder_is_created_private(tmp_path: Path) -> None:
    assert library_folder(tmp_path / "run" / "mlruns") == tmp_path / "run" / "mlruns"
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "mlruns").st_mode) & 0o027 == 0


def test_an_existing_tree_of_files_and_folders_is_accepted_untouched(tmp_path: Path) -> None:
    store = tmp_path / "mlruns"
    (store / "0" / "abc" / "metrics").mkdir(parents=True, mode=0o750)
    os.chmod(store, 0o750)
    (store / "0" / "meta.yaml").write_text("name: Default\n")
    (store / "0" / "abc" / "metrics" / "loss").write_text("1 0.5 1\n")
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    assert library_folder(store) == store
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before


@pytest.mark.parametrize("plant", ["symlink", "file"])
def test_something_else_at_the_folder_is_refused(tmp_path: Path, plant: str) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    store = tmp_path / "mlruns"
    if plant == "symlink":
        store.symlink_to(victim)
    else:
        store.write_text("")
    with pytest.raises(UnsafePath, match=f"{store} is a (symlink|plain file), not a directory"):
        library_folder(store)
    assert os.listdir(victim) == []


@pytest.mark.parametrize("plant", ["link to a folder", "link to a file", "dangling link", "fifo"])
def test_a_link_or_special_file_anywhere_inside_is_refused(tmp_path: Path, plant: str) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "theirs").write_text("theirs")
    store = tmp_path / "tensorboard"
    deep = store / "a" / "b"
    deep.mkdir(parents=True)
    os.chmod(store, 0o750)
    (store / "events.out").write_text("")
    entry = deep / "entry"
    if plant == "link to a folder":
        entry.symlink_to(victim)
    elif plant == "link to a file":
        entry.symlink_to(victim / "theirs")
    elif plant == "dangling link":
        entry.symlink_to(victim / "not-yet")
    else:
        os.mkfifo(entry)
    what = "not a plain file or folder" if plant == "fifo" else "a symlink"
    with pytest.raises(UnsafePath, match=f"refusing to log into {store}: {entry} is {what}"):
        library_folder(store)


def test_a_folder_others_can_write_is_refused_unless_the_run_is_shared(tmp_path: Path) -> None:
    store = tmp_path / "mlruns"
    store.mkdir()
    os.chmod(store, 0o770)
    with pytest.raises(UnsafePath, match="writable by the group"):
        library_folder(store)
    assert library_folder(store, shared=True) == store  # a team run: the group is trusted
    os.chmod(store, 0o777)
    with pytest.raises(UnsafePath, match="writable by every user"):
        library_folder(store, shared=True)
