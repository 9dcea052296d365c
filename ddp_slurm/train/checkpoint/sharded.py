"""Sharded checkpoints (``dist.strategy=fsdp``): ``<run_dir>/checkpoints/step-<N>/``, one part per rank.

On disk::

    checkpoints/step-120/
        __0_0.distcp  __1_0.distcp ...   each rank's shards of the model and optimizer (torch DCP)
        .metadata                        DCP's index: which bytes of which file hold which tensor slice
        seal-0.json  seal-1.json ...     each rank's seal of the files it wrote (XXH3-128, as seal.py)
        commit.pt                        written last: step, position, schedule, task state, every rank's
                                         RNG streams, config, and the seal of every file above; sealed itself

Writing: every rank hands its shards to ``torch.distributed.checkpoint.async_save``, which copies them
to host memory (pinned for GPU tensors) and returns; a background thread writes and fsyncs this rank's
file into ``checkpoints/.step-<N>.partial/``, hashes it (``seal-<rank>.json``), and DCP's coordinator
writes ``.metadata`` once every rank's part is written. Then rank 0 writes ``commit.pt`` and renames
the folder to ``step-<N>``: a folder of that name exists only when every part is durable, so a kill at
any moment leaves the previous checkpoint the newest one. The background collectives run on a gloo
group of their own, never interleaved with training's.

Reading: ``latest`` walks from the newest step down; a checkpoint counts when ``commit.pt``'s own seal
holds, every file it names is there with its seal, and the run accepts it (config, model shapes).
Loading reshards with DCP when the world size changed (``restore``). Pruning counts only checkpoints
that pass the same commit check.

A write in flight cannot be cancelled (DCP has no way to stop one): an urgent save (a stop signal, the
end) waits for it and then writes its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.serialization import config as torch_serialization

from ddp_slurm import safefs
from ddp_slurm.train import state
from ddp_slurm.train.checkpoint import seal as ckpt_seal
from ddp_slurm.train.checkpoint.format import CheckpointError, UnsafeCheckpoint, checkpoint_dir, raise_none_usable
from ddp_slurm.train.step import all_finite

log = logging.getLogger(__name__)

SHARDED_FORMAT = 1
COMMIT = "commit.pt"
_DIR = re.compile(r"^step-(\d+)$")


def dir_name(step: int | str) -> str:
    return f"step-{step}"


def partial_name(step: int | str) -> str:
    return f".step-{step}.partial"


def list_sharded(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-N`` folder, newest first (committed or not: see ``read_commit``)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def strategy_conflict(run_dir: Path, strategy: str) -> str | None:
    """Why ``run_dir``'s checkpoints cannot be resumed under ``strategy`` (None: they can). A run keeps
    the strategy it started with: single files (ddp) and sharded folders (fsdp) are not converted."""
    from ddp_slurm.train.checkpoint.format import list_checkpoints

    other = {"ddp": "fsdp", "fsdp": "ddp"}[strategy]
    theirs = list_sharded(run_dir) if strategy == "ddp" else list_checkpoints(run_dir)
    if not theirs:
        return None
    return (
        f"run directory {run_dir} holds dist.strategy={other} checkpoints ({theirs[0][1].name}); a run keeps its "
        f"strategy: launch with dist.strategy={other} to resume it, or choose another run.name"
    )


def file_seal(path: Path) -> str:
    """The XXH3-128 tree hash of a file's bytes, sliced as ``seal.py`` slices a checkpoint file."""
    scheme, digests = ckpt_seal.XXH3, []
    with open(path, "rb") as f:
        while chunk := f.read(ckpt_seal.SLICE):
            h = scheme.new()
            h.update(chunk)
            digests.append(h.digest())
    return scheme.seal_of(digests)


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def commit(partial: Path, final: Path, record: dict[str, Any], world_size: int, shared: bool) -> None:
    """Rank 0, once every rank's part is written: ``commit.pt`` with every file's seal, then the rename."""
    files: dict[str, str] = {}
    for rank in range(world_size):
        seal_file = partial / f"seal-{rank}.json"
        if not seal_file.exists():
            raise CheckpointError(f"cannot commit checkpoint {final}: rank {rank}'s part has no seal")
        files.update(json.loads(seal_file.read_text()))
    files[".metadata"] = file_seal(partial / ".metadata")
    dir_mode, file_mode = safefs.modes(shared)  # DCP creates with the umask's modes: the run's own instead
    for path in partial.iterdir():
        os.chmod(path, file_mode)
    os.chmod(partial, dir_mode)
    record = dict(record, format=SHARDED_FORMAT, files=files)

    def write(f: Any) -> None:
        sink = ckpt_seal.Sink(f)
        with torch_serialization.patch({"save.compute_crc32": False}):
            torch.save(record, sink)
        sink.seal()

    safefs.write_atomic(partial / COMMIT, write, shared)
    safefs.fsync_dir(partial)
    if final.exists():  # a step written by an earlier launch that resumed from before it: the new one wins
        shutil.rmtree(final)
    os.replace(partial, final)
    safefs.fsync_dir(final.parent)


def read_commit(folder: Path, verify_files: bool = True) -> dict[str, Any]:
    """The commit record of a sharded checkpoint, after its seal (and with ``verify_files`` every file's)
    holds; ValueError with the reason otherwise."""
    path = folder / COMMIT
    try:
        with open(path, "rb") as f:
            sealed = ckpt_seal.check(f)
            f.seek(0)
            record = torch.load(f, map_location="cpu", weights_only=True)
    except ckpt_seal.Mismatch as exc:
        raise ValueError(f"{COMMIT}: {exc}") from None
    except FileNotFoundError:
        raise ValueError(f"no {COMMIT} (never committed)") from None
    except Exception as exc:
        raise ValueError(f"{COMMIT} unreadable ({type(exc).__name__})") from None
    if sealed is not ckpt_seal.XXH3:
        raise ValueError(f"{COMMIT} has no seal (cut short, or written by another program)")
    if (
        not isinstance(record, dict)
        or record.get("format") != SHARDED_FORMAT
        or not isinstance(record.get("step"), int)
    ):
        raise ValueError(f"{COMMIT} is not a sharded checkpoint record of this program")
    if verify_files:
        for name, seal in record["files"].items():
            if not (folder / name).is_file():
                raise ValueError(f"{name} is missing")
            if file_seal(folder / name) != seal:
                raise ValueError(f"{name}: content digest mismatch (corrupted data)")
    return record


def check_trusted(run_dir: Path, shared: bool) -> None:
    """``safefs.check_trusted`` on every sharded checkpoint folder and file, before anything is read."""
    try:
        for _, folder in list_sharded(run_dir):
            safefs.check_trusted(folder, shared)
            for path in folder.iterdir():
                safefs.check_trusted(path, shared)
    except safefs.UnsafePath as exc:
        raise UnsafeCheckpoint(str(exc)) from None


def latest(
    run_dir: Path, accept: Callable[[dict[str, Any]], None] | None = None, shared: bool = False
) -> tuple[Path, dict[str, Any]] | None:
    """``(folder, record)`` of the newest committed, verified and accepted sharded checkpoint (as
    ``checkpoint.latest``: each one skipped is named, none usable among several is an error).
    ``accept`` sees the record with ``model`` holding meta tensors of the saved shapes."""
    candidates = list_sharded(run_dir)
    if candidates:
        safefs.check_trusted(checkpoint_dir(run_dir), shared)
    check_trusted(run_dir, shared)
    for step, folder in candidates:
        try:
            record = read_commit(folder)
            if record["step"] != step:
                raise ValueError(f"it holds step {record['step']}, not the step its name says")
            if accept is not None:
                shapes = {k: torch.empty(s, device="meta") for k, s in record["model_shapes"].items()}
                accept(dict(record, model=shapes))
            return folder, record
        except ValueError as exc:
            log.warning("skipping checkpoint %s: %s", folder, exc)
    if candidates:
        raise_none_usable(run_dir, [p for _, p in candidates])
    return None


def prune(run_dir: Path, keep: int, newest: Path) -> None:
    """Delete all but the ``keep`` newest committed checkpoints (by the step in their record; anything
    that does not pass the commit check is left alone, as ``checkpoint.prune`` does)."""
    trusted = []
    for step, folder in list_sharded(run_dir):
        try:
            if read_commit(folder, verify_files=False)["step"] != step:
                continue
        except ValueError:
            continue
        trusted.append((folder == newest, step, folder))
    trusted.sort(reverse=True)
    for _, _, old in trusted[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_partials(run_dir: Path) -> None:
    """Folders of writes that never committed (a killed launch): never valid checkpoints."""
    folder = checkpoint_dir(run_dir)
    if folder.is_dir():
        for p in folder.glob(partial_name("*")):
            shutil.rmtree(p, ignore_errors=True)


def model_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """The full (unsharded) shape of every tensor of the model's state dict: what ``same_model`` checks."""
    return {k: list(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def capture(
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    task: Any,
    pos: state.Position,
    finished: bool,
    elapsed_s: float,
    extra: dict[str, Any],
    device: torch.device,
    rank: int,
    world_size: int,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(this rank's shards, the commit record on rank 0 / None elsewhere). A collective."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    # one host sync for every local shard (a sync per tensor is what train.step.all_finite avoids)
    finite = torch.tensor([float(all_finite(p.to_local() for p in model.parameters() if p.is_floating_point()))])
    if world_size > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not finite.item():
        raise ValueError(f"weights are not finite at step {pos.step}")
    rngs = state.gather(state.rng_state(device), rank, world_size)
    record = None
    if rank == 0:
        assert rngs is not None
        own = {"model_shapes": model_shapes(model)}
        record = state.record(scheduler, task, pos, finished, elapsed_s, rngs, world_size) | own | extra
    return {"model": msd, "optim": osd}, record


def restore(
    folder: Path,
    record: dict[str, Any],
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    task: Any,
    seed: int,
    device: torch.device,
    rank: int,
    world_size: int,
) -> state.Position:
    """Load a sharded checkpoint into the sharded model and optimizer on every rank (a collective); DCP
    reshards when the checkpoint was written at another world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    shards = {"model": msd, "optim": osd}
    dcp.load(shards, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optim"])
    return state.resume_rest(
        record,
        scheduler,
        task,
        seed,
        device,
        rank,
        world_size,
        what="a sharded checkpoint",
        changed="shards re-split by DCP, same samples and order, fresh per-rank RNG streams (see docs/scaling.md)",
    )


def load_full(folder: Path, record: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint as one state on this process: the record plus the whole ``model`` and
    ``optimizer`` (state keyed by parameter name), read without a process group. For inspection and
    export (``checkpoint.load_latest``); training resumes through ``restore``."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        full = _load_state_dict_from_keys(checkpoint_id=str(folder))
    return dict(record, model=full["model"], optimizer=full["optim"])


def load_latest_full(run_dir: Path) -> dict[str, Any] | None:
    """``checkpoint.load_latest`` for a run of sharded checkpoints."""
    found = latest(Path(run_dir))
    return None if found is None else load_full(*found)
