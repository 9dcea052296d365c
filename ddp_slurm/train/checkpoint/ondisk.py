"""How a checkpoint lies on disk, one half of a backend (``backends.py``; the other half, how the model and optimizer
state is captured and put back, is ``capture.py``): which entries of the run directory are its checkpoints,
whether a path is one, trusting, reading (the record of the run's parts and what else makes it whole), the
cheap summary pruning judges by, what a killed writer left, and the writer of new ones.

- ``WholeFileDisk``: ``checkpoints/step-<N>.pt``, one sealed file (``wholefile.py``, ``listing.py``) written in the
  background (``writer.AsyncCheckpointer``);
- ``ShardedDisk``: ``checkpoints/step-<N>/``, every rank's DCP shards and a sealed commit record (``sharded.py``),
  committed by rank 0 (``sharded_writer.py``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import fit, listing, schema, sharded, state, wholefile
from ddp_slurm.train.checkpoint.parts import Check

Shape = tuple[int, ...]


def _plain_file(path: Path) -> None:
    """UnsafePath unless ``path`` is a plain file (a FIFO would block the read, a device never end)."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise safefs.UnsafePath(f"refusing to resume from {path}: it is not a plain file; remove it")


class OnDisk:
    """The on-disk half (see the module docstring). ``kind`` names the format (not a strategy: any strategy may
    write any format its capture half can feed); ``owns``: the record keys that are the format's own, no part's;
    ``extra``: record keys the schema checks too."""

    kind: ClassVar[str]
    owns: ClassVar[frozenset[str]] = frozenset()
    extra: ClassVar[dict[str, Check]] = {}

    def holds(self, path: Path) -> bool:
        """Whether ``path`` is one of this format's checkpoints by its own marks (not whether it is whole)."""
        raise NotImplementedError

    def candidates(self, paths: RunPaths) -> list[tuple[int, Path]]:
        """``(step, path)`` of what looks like this backend's checkpoints, newest first."""
        raise NotImplementedError

    def trust(self, path: Path, shared: bool) -> None:
        """UnsafePath unless ``path`` (and everything in it) could only have been written by this run."""
        raise NotImplementedError

    def read(self, path: Path, *, verify: bool = True) -> dict[str, Any]:
        """The checkpoint's record (the whole state for a file), once it is whole; ValueError otherwise.
        ``verify=False``: a reader that trusts an earlier check (the other ranks, after rank 0's)."""
        raise NotImplementedError

    def summary(self, path: Path) -> tuple[int, Any, dict[str, Shape]]:
        """(step, recorded config, model shapes), read cheaply: what pruning judges by."""
        raise NotImplementedError

    def shapes(self, record: dict[str, Any]) -> dict[str, Shape]:
        raise NotImplementedError

    def layout(self, record: dict[str, Any]) -> fit.Layout | None:
        """The saved optimizer's layout (``fit``), None where the record has none to compare."""
        raise NotImplementedError

    def load_whole(self, path: Path, record: dict[str, Any]) -> dict[str, Any]:
        """The record with the whole ``model`` (and ``optimizer``) state dict, on this process."""
        raise NotImplementedError

    def remove_stale(self, paths: RunPaths) -> None:
        """What a killed writer left (temporary files, partial folders): never checkpoints."""
        raise NotImplementedError

    def writer(
        self,
        paths: RunPaths,
        section: Any,
        *,
        stop_pending: Callable[[], bool] | None,
        prune: Callable[[Path], None],
    ) -> Any:
        """The writer of this backend's checkpoints (``checkpoint.async`` from ``section``; ``prune(newest)``
        after each durable write): ``save(snapshot, urgent)``, ``wait``, ``collect_durable``, ``close``, ``failed``,
        ``in_flight``."""
        raise NotImplementedError


class WholeFileDisk(OnDisk):
    kind = "whole-file"
    owns = frozenset({"format", "model", "optimizer"})
    extra = {
        "model": (lambda v: isinstance(v, dict), "a state dict"),
        "optimizer": (lambda v: isinstance(v, dict), "a state dict"),
    }

    def holds(self, path: Path) -> bool:
        return path.suffix == ".pt" and not path.is_dir()  # a file of the format's name, wherever it was copied

    def candidates(self, paths: RunPaths) -> list[tuple[int, Path]]:
        return listing.list_checkpoints(paths.root)

    def trust(self, path: Path, shared: bool) -> None:
        safefs.check_trusted(path, shared)
        _plain_file(path)

    def read(self, path: Path, *, verify: bool = True) -> dict[str, Any]:
        return state.upgrade(wholefile.load(path))

    def summary(self, path: Path) -> tuple[int, Any, dict[str, Shape]]:
        return listing.summary(path)

    def shapes(self, record: dict[str, Any]) -> dict[str, Shape]:
        return {k: tuple(v.shape) for k, v in record["model"].items() if isinstance(v, torch.Tensor)}

    def layout(self, record: dict[str, Any]) -> fit.Layout | None:
        return fit.layout_of_state_dict(record.get("optimizer"))

    def load_whole(self, path: Path, record: dict[str, Any]) -> dict[str, Any]:
        return record

    def remove_stale(self, paths: RunPaths) -> None:
        wholefile.remove_stale_temporaries(paths.root)

    def writer(
        self, paths: RunPaths, section: Any, *, stop_pending: Callable[[], bool] | None, prune: Callable[[Path], None]
    ) -> Any:
        from ddp_slurm.train.checkpoint.wholefile_writer import AsyncCheckpointer

        return AsyncCheckpointer(
            paths.root,
            section.keep,
            enabled=section.async_save,
            shared=paths.shared,
            stop_pending=stop_pending,
            prune=prune,
            parents=False,
        )


class ShardedDisk(OnDisk):
    kind = "sharded"
    owns = frozenset({"format", "model_shapes", "optimizer_layout", "files"})
    extra = {
        "model_shapes": (lambda v: isinstance(v, dict) and bool(v), "a mapping of tensor shapes"),
        "world_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a count of ranks"),
    }

    def holds(self, path: Path) -> bool:
        return os.path.lexists(path / sharded.COMMIT)  # its commit record, written last

    def candidates(self, paths: RunPaths) -> list[tuple[int, Path]]:
        return sharded.list_sharded(paths)

    def trust(self, path: Path, shared: bool) -> None:
        safefs.check_trusted(path, shared)
        for entry in sorted(path.iterdir()):
            safefs.check_trusted(entry, shared)
            _plain_file(entry)

    def read(self, path: Path, *, verify: bool = True) -> dict[str, Any]:
        record = sharded.read_commit(path)
        if verify:
            sharded.check_files(path, record)
            sharded.check_index(path, record)
        return record

    def summary(self, path: Path) -> tuple[int, Any, dict[str, Shape]]:
        record = sharded.read_commit(path)
        return record["step"], record.get("config"), schema.shapes(record["model_shapes"])

    def shapes(self, record: dict[str, Any]) -> dict[str, Shape]:
        return schema.shapes(record["model_shapes"])

    def layout(self, record: dict[str, Any]) -> fit.Layout | None:
        saved = record.get("optimizer_layout")
        return None if saved is None and record["format"] < 2 else fit.layout_of_record(saved)

    def load_whole(self, path: Path, record: dict[str, Any]) -> dict[str, Any]:
        import warnings

        from ddp_slurm.train.checkpoint import dcp_safe

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            whole = dcp_safe.load_whole(path)
        return dict(record, model=whole["model"], optimizer=whole["optim"])

    def remove_stale(self, paths: RunPaths) -> None:
        sharded.remove_stale_partials(paths)

    def writer(
        self, paths: RunPaths, section: Any, *, stop_pending: Callable[[], bool] | None, prune: Callable[[Path], None]
    ) -> Any:
        from ddp_slurm.train.checkpoint.sharded_writer import ShardedCheckpointer

        return ShardedCheckpointer(paths, section.async_save, prune=prune)
