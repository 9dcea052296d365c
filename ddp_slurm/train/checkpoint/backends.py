"""The two ways a checkpoint lies on disk, behind one interface the gate and the checkpointer use.

- ``WholeFile`` (``dist.strategy=ddp``): ``checkpoints/step-<N>.pt``, rank 0's whole state in one sealed
  file (``format.py``), written by rank 0 in the background (``writer.AsyncCheckpointer``);
- ``Sharded`` (``dist.strategy=fsdp``): ``checkpoints/step-<N>/``, every rank's shards and a sealed commit
  record (``sharded.py``), written by every rank and committed by rank 0 (``sharded_writer.py``).

Each says which entries of the folder are its checkpoints, how to read one's record (the values of the run's
registered parts, ``parts.py``) and what else makes it whole, how to capture the run's state and
put it back, and how to read it whole on one process (tools, export, warm start). Everything a backend
does not decide (trust, the record's shape, being this run's, fitting) is the gate's (``gate.py``), for
both: that is how a rule the file format keeps is kept by the folder too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import fit, format, listing, schema, sharded, state
from ddp_slurm.train.checkpoint.parts import Moment, Restoring
from ddp_slurm.train.checkpoint.standard import parts_of
from ddp_slurm.train.checkpoint.state import Position

Shape = tuple[int, ...]


class Objects(Protocol):
    """What a checkpoint is captured from and restored into: the run's objects (``train/run.py``)."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    task: Any
    pos: Position
    device: torch.device
    rank: int
    world_size: int
    seed: int
    groups: Any  # distributed.groups.Groups: the RNG streams and flags travel on its host group
    # ``parts`` (``parts.Parts``): what the checkpoint holds beside the model and optimizer; a stand-in without
    # it (a test's, a benchmark's) gets the standard parts (``standard.parts_of``)


def _plain_file(path: Path) -> None:
    """UnsafePath unless ``path`` is a plain file (a FIFO would block the read, a device never end)."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise safefs.UnsafePath(f"refusing to resume from {path}: it is not a plain file; remove it")


class Backend:
    """The interface (see the module docstring); ``name`` is the ``dist.strategy`` that writes it."""

    name: ClassVar[str]
    extra: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}  # record keys the schema checks too
    owns: ClassVar[frozenset[str]] = frozenset()  # record keys of the backend's own (no part's): the model state

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

    def capture(self, run: Objects, finished: bool, elapsed_s: float, extra: dict[str, Any]) -> Any:
        """The state to write after this step (a collective). DoesNotFit is not raised here; a
        ValueError says the weights are not finite."""
        raise NotImplementedError

    def restore(self, path: Path, record: dict[str, Any], run: Objects) -> Position:
        """Load the checkpoint into ``run`` on this rank (a collective where the backend needs one)."""
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

    def writes(self, run: Objects, write: Callable[[], Any]) -> Any:
        """Run ``write`` where this backend writes (every rank calls this at the same step); its result, or
        its exception, on every rank."""
        raise NotImplementedError


def _record(run: Objects, finished: bool, elapsed_s: float) -> dict[str, Any] | None:
    """Every registered part's values (a collective: the per-rank ones travel on the host group); rank 0's
    record, None on the others."""
    return parts_of(run).take(
        Moment(finished, elapsed_s), lambda own: state.gather(own, run.rank, run.world_size, run.groups.host)
    )


def _rest(backend: Backend, record: dict[str, Any], run: Objects, what: str, where: str) -> Position:
    """Every registered part put back from ``record``, for either backend; the position to continue from."""
    how = Restoring(
        run.rank,
        run.world_size,
        run.seed,
        run.device,
        what,
        f"same samples and order, fresh per-rank RNG streams {where}",
    )
    parts_of(run).put(record, how, owned=backend.owns)
    return run.pos


class WholeFile(Backend):
    name = "ddp"
    owns = frozenset({"format", "model", "optimizer"})
    extra = {
        "model": (lambda v: isinstance(v, dict), "a state dict"),
        "optimizer": (lambda v: isinstance(v, dict), "a state dict"),
    }

    def candidates(self, paths: RunPaths) -> list[tuple[int, Path]]:
        return listing.list_checkpoints(paths.root)

    def trust(self, path: Path, shared: bool) -> None:
        safefs.check_trusted(path, shared)
        _plain_file(path)

    def read(self, path: Path, *, verify: bool = True) -> dict[str, Any]:
        return state.upgrade(format.load(path))

    def summary(self, path: Path) -> tuple[int, Any, dict[str, Shape]]:
        return listing.summary(path)

    def shapes(self, record: dict[str, Any]) -> dict[str, Shape]:
        return {k: tuple(v.shape) for k, v in record["model"].items() if isinstance(v, torch.Tensor)}

    def layout(self, record: dict[str, Any]) -> fit.Layout | None:
        return fit.layout_of_state_dict(record.get("optimizer"))

    def capture(self, run: Objects, finished: bool, elapsed_s: float, extra: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0's whole state (None on the others, which only hand over their RNG streams)."""
        from ddp_slurm.train.step import all_finite

        record = _record(run, finished, elapsed_s)
        if record is None:
            return None
        if not all_finite(run.model.parameters()):  # one host sync for all of them; rank 0 raises it when writing
            raise ValueError(f"weights are not finite at step {run.pos.step}")
        whole = {"format": format.FORMAT, "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()}
        return whole | record | extra

    def restore(self, path: Path, record: dict[str, Any], run: Objects) -> Position:
        run.model.load_state_dict(record["model"])
        run.optimizer.load_state_dict(record["optimizer"])
        return _rest(self, record, run, "a checkpoint", "(see docs/tasks.md, 'Resume')")

    def load_whole(self, path: Path, record: dict[str, Any]) -> dict[str, Any]:
        return record

    def remove_stale(self, paths: RunPaths) -> None:
        format.remove_stale_temporaries(paths.root)

    def writer(
        self, paths: RunPaths, section: Any, *, stop_pending: Callable[[], bool] | None, prune: Callable[[Path], None]
    ) -> Any:
        from ddp_slurm.train.checkpoint.writer import AsyncCheckpointer

        return AsyncCheckpointer(
            paths.root,
            section.keep,
            enabled=section.async_save,
            shared=paths.shared,
            stop_pending=stop_pending,
            prune=prune,
            parents=False,
        )

    def writes(self, run: Objects, write: Callable[[], Any]) -> Any:
        """Rank 0 writes the whole file; the others learn how it went."""
        from ddp_slurm.distributed.group import on_rank0

        return on_rank0(run, write, run.groups.host)


class Sharded(Backend):
    name = "fsdp"
    owns = frozenset({"format", "model_shapes", "optimizer_layout", "files"})
    extra = {
        "model_shapes": (lambda v: isinstance(v, dict) and bool(v), "a mapping of tensor shapes"),
        "world_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a count of ranks"),
    }

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

    def capture(
        self, run: Objects, finished: bool, elapsed_s: float, extra: dict[str, Any]
    ) -> tuple[dict[str, Any], Any]:
        """(this rank's shards, the commit record on rank 0 / None elsewhere). A collective."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from ddp_slurm.train.step import take_rank0_buffers

        take_rank0_buffers(run.model, run.world_size, run.groups.train)  # the one copy DCP keeps: rank 0's
        msd, osd = get_state_dict(run.model, run.optimizer)
        if not sharded.finite(run.model, run.world_size, run.groups.host):  # agreed: every rank raises, or none
            raise ValueError(f"weights are not finite at step {run.pos.step}")
        record = _record(run, finished, elapsed_s)
        if record is not None:  # rank 0
            own = {
                "model_shapes": sharded.model_shapes(run.model),
                "optimizer_layout": sharded.optimizer_layout(run.optimizer, osd),
            }
            record = record | own | extra
        return {"model": msd, "optim": osd}, record

    def restore(self, path: Path, record: dict[str, Any], run: Objects) -> Position:
        """Every rank loads its shards (DCP reshards when the world size changed), read safely."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from ddp_slurm.train.checkpoint import dcp_safe

        msd, osd = get_state_dict(run.model, run.optimizer)
        shards = {"model": msd, "optim": osd}
        try:
            dcp_safe.load(shards, path, run.groups.host)  # DCP's planning: pickled objects
        except dcp_safe.FAILED as exc:  # the gate checked the index against the run: this is a read failing
            raise format.CheckpointError(f"cannot load checkpoint {path}: {dcp_safe.unwrap(exc)}") from None
        set_state_dict(run.model, run.optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optim"])
        return _rest(self, record, run, "a sharded checkpoint", "(shards re-split by DCP; see docs/scaling.md)")

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

    def writes(self, run: Objects, write: Callable[[], Any]) -> Any:
        """Every rank writes its own shards (a collective): each raises the same error itself."""
        return write()


BACKENDS: tuple[Backend, ...] = (WholeFile(), Sharded())


def backend_at(path: Path) -> Backend:
    """The backend of one checkpoint named by its path: a folder of shards, or a whole file."""
    return Sharded() if path.is_dir() else WholeFile()
