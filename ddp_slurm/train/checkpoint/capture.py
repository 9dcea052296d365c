"""How the model and optimizer state is captured and put back, one half of a backend (``backends.py``; the other
half, how a checkpoint lies on disk, is ``ondisk.py``). Both capture the run's registered parts
(``parts.py``) beside the model and optimizer, and put every part back on a restore.

- ``RankZeroCapture``: rank 0's whole state dicts (the others hand over their per-rank parts); rank 0 writes;
- ``ShardedCapture``: every rank's shards through DCP (resharded at another world size); every rank writes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from ddp_slurm.train.checkpoint import sharded, state, wholefile
from ddp_slurm.train.checkpoint.parts import Moment, Restoring
from ddp_slurm.train.checkpoint.standard import parts_of
from ddp_slurm.train.checkpoint.state import Position


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


class Capture:
    """The capture half (see the module docstring). ``owns``: the record keys of the format it is paired with
    (the on-disk half's), which no part claims."""

    owns: ClassVar[frozenset[str]] = frozenset()

    def capture(self, run: Objects, finished: bool, elapsed_s: float, extra: dict[str, Any]) -> Any:
        """The state to write after this step (a collective). DoesNotFit is not raised here; a
        ValueError says the weights are not finite."""
        raise NotImplementedError

    def restore(self, path: Path, record: dict[str, Any], run: Objects) -> Position:
        """Load the checkpoint into ``run`` on this rank (a collective where the backend needs one)."""
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


def _rest(backend: Capture, record: dict[str, Any], run: Objects, what: str, where: str) -> Position:
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


class RankZeroCapture(Capture):
    def capture(self, run: Objects, finished: bool, elapsed_s: float, extra: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0's whole state (None on the others, which only hand over their RNG streams)."""
        from ddp_slurm.train.step import all_finite

        record = _record(run, finished, elapsed_s)
        if record is None:
            return None
        if not all_finite(run.model.parameters()):  # one host sync for all of them; rank 0 raises it when writing
            raise ValueError(f"weights are not finite at step {run.pos.step}")
        whole = {"format": wholefile.FORMAT, "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()}
        return whole | record | extra

    def restore(self, path: Path, record: dict[str, Any], run: Objects) -> Position:
        run.model.load_state_dict(record["model"])
        run.optimizer.load_state_dict(record["optimizer"])
        return _rest(self, record, run, "a checkpoint", "(see docs/tasks.md, 'Resume')")

    def writes(self, run: Objects, write: Callable[[], Any]) -> Any:
        """Rank 0 writes the whole file; the others learn how it went."""
        from ddp_slurm.distributed.group import on_rank0

        return on_rank0(run, write, run.groups.host)


class ShardedCapture(Capture):
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
            raise wholefile.CheckpointError(f"cannot load checkpoint {path}: {dcp_safe.unwrap(exc)}") from None
        set_state_dict(run.model, run.optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optim"])
        return _rest(self, record, run, "a sharded checkpoint", "(shards re-split by DCP; see docs/scaling.md)")

    def writes(self, run: Objects, write: Callable[[], Any]) -> Any:
        """Every rank writes its own shards (a collective): each raises the same error itself."""
        return write()
