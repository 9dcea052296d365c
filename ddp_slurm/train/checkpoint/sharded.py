"""Sharded checkpoints (``dist.strategy=fsdp``): ``<run_dir>/checkpoints/step-<N>/``, one part per rank.

On disk::

    checkpoints/step-120/
        __0_0.distcp  __1_0.distcp ...   each rank's shards of the model and optimizer (torch DCP)
        .metadata                        DCP's index: which bytes of which file hold which tensor slice
        seal-0.json  seal-1.json ...     each rank's seal of the files it wrote (XXH3-128, as seal.py)
        commit.pt                        written last: the record of the run's parts (parts.py),
                                         the model's shapes, the optimizer's layout, and the seal of every
                                         file above; sealed itself

Writing (``sharded_writer.py``): rank 0 makes ``.step-<N>.partial/`` afresh (no entry of that name survives
from before: a planted symlink there would take every rank's shards elsewhere); every rank's DCP writer
fills it; rank 0 checks that it holds exactly the files the ranks sealed, plain files, then writes
``commit.pt`` and renames the folder to ``step-<N>``: a folder of that name exists only when every part
is durable, so a kill at any moment leaves the previous checkpoint the newest one.

Reading: a folder counts as a checkpoint when it holds ``commit.pt``; the gate (``gate.py``) then checks
it like any checkpoint (trust, seal, record, this run's, fits), and this module adds the folder's own
rules: every file the commit names is there with its seal, nothing else is, and DCP's index agrees with
the commit (every tensor of the model and of the optimizer's layout, at its recorded size). The index
and every value are read without unpickling anything a co-tenant could write (``dcp_safe.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.serialization import config as torch_serialization

from ddp_slurm import safefs
from ddp_slurm.runpaths import RunPaths
from ddp_slurm.train.checkpoint import dcp_safe, schema
from ddp_slurm.train.checkpoint import seal as ckpt_seal
from ddp_slurm.train.checkpoint.errors import CheckpointError

SHARDED_FORMAT = 2  # 2: the optimizer's layout in the commit; 1 (read): without it
READABLE = (1, 2)
COMMIT = "commit.pt"
METADATA = ".metadata"
_DIR = re.compile(r"^step-(\d+)$")
_PART = re.compile(r"^(__\d+_\d+\.distcp|seal-\d+\.json)$")
_HEX = re.compile(r"^[0-9a-f]{32}$")


def list_sharded(paths: RunPaths) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-N`` entry that holds a ``commit.pt``, newest first. A folder
    without one is not a checkpoint (a write that never committed, or someone's empty folder): it is
    neither resumed, nor counted, nor a reason to refuse a run."""
    folder = paths.checkpoints
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _DIR.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and os.path.lexists(p / COMMIT):
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def file_seal(path: Path) -> str:
    """The XXH3-128 tree hash of a file's bytes, sliced as ``seal.py`` slices a checkpoint file."""
    scheme, digests = ckpt_seal.XXH3, []
    with open(path, "rb") as f:
        while chunk := f.read(ckpt_seal.SLICE):
            h = scheme.new()
            h.update(chunk)
            digests.append(h.digest())
    return scheme.seal_of(digests)


def write_json(path: Path, data: Any) -> None:
    """A rank's seal file, created exclusively (never through a planted name) and fsynced."""
    fd = safefs.open_new(path)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def fresh_partial(partial: Path, shared: bool) -> None:
    """Rank 0, before a sharded write: ``partial`` as a new, empty folder of ours (whatever was there,
    a stale write or a planted symlink, is removed without following it)."""
    remove(partial)
    dir_mode, _ = safefs.modes(shared)
    os.mkdir(partial, dir_mode)
    if shared:
        os.chmod(partial, dir_mode)


def remove(path: Path) -> None:
    """Remove a folder tree, or a symlink or file in its place, never following a link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # rmtree does not follow symlinks inside the tree
    else:
        os.unlink(path)


def remove_stale_partials(paths: RunPaths) -> None:
    """Folders (or anything else under their names) of writes that never committed: never checkpoints."""
    folder = paths.checkpoints
    if folder.is_dir() and not folder.is_symlink():
        for p in folder.glob(paths.partial("*").name):
            try:
                remove(p)
            except OSError:
                pass


def commit(partial: Path, final: Path, record: dict[str, Any], world_size: int, shared: bool) -> None:
    """Rank 0, once every rank's part is written: ``commit.pt`` with every file's seal, then the rename.

    The folder must hold exactly what the ranks wrote: each rank's seal file, the files they sealed and
    DCP's index, all plain files; anything else (a link, a folder, a file nobody sealed) is refused
    rather than committed or chmod-ed."""
    files: dict[str, str] = {}
    for rank in range(world_size):
        seal_file = partial / f"seal-{rank}.json"
        if not seal_file.is_file() or seal_file.is_symlink():
            raise CheckpointError(f"cannot commit checkpoint {final}: rank {rank}'s part has no seal")
        files.update(json.loads(seal_file.read_text()))
    expected = set(files) | {METADATA} | {f"seal-{r}.json" for r in range(world_size)}
    found = {p.name for p in partial.iterdir()}
    if found != expected:
        odd = sorted(found ^ expected)[:3]
        raise CheckpointError(f"cannot commit checkpoint {final}: its folder holds other entries than written ({odd})")
    _, file_mode = safefs.modes(shared)
    for name in sorted(found):  # DCP creates with the umask's modes: the run's own instead, never via a link
        fd = os.open(partial / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"cannot commit checkpoint {final}: {name} is not a plain file")
            os.fchmod(fd, file_mode)
        finally:
            os.close(fd)
    files[METADATA] = file_seal(partial / METADATA)
    record = dict(record, format=SHARDED_FORMAT, files=files)

    sinks: list[ckpt_seal.Sink] = []

    def write(f: Any) -> None:
        sinks.append(ckpt_seal.Sink(f))
        with torch_serialization.patch({"save.compute_crc32": False}):
            torch.save(record, sinks[0])
        sinks[0].seal()

    try:
        safefs.write_atomic(partial / COMMIT, write, shared)
        safefs.fsync_dir(partial)
    except (OSError, RuntimeError) as exc:  # torch's zip writer hides a failed write's reason: the sink kept it
        cause = sinks[0].error if sinks and sinks[0].error is not None else exc
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause).splitlines()[0]
        raise CheckpointError(f"cannot write checkpoint {final}: {reason}; previous checkpoints are intact") from None
    if os.path.lexists(final):  # a step written by an earlier launch that resumed from before it: the new one wins
        remove(final)
    os.replace(partial, final)
    safefs.fsync_dir(final.parent)


def read_commit(folder: Path) -> dict[str, Any]:
    """The commit record of a sharded checkpoint once its own seal holds and its own keys are well formed
    (format, files); ValueError with the reason otherwise. The files themselves: ``check_files``."""
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
    if not isinstance(record, dict) or record.get("format") not in READABLE or not isinstance(record.get("step"), int):
        raise ValueError(f"{COMMIT} is not a sharded checkpoint record of this program")
    files = record.get("files")
    if not isinstance(files, dict) or METADATA not in files:
        raise ValueError(f"{COMMIT} names no files")
    for name, seal in files.items():
        if not (isinstance(name, str) and (name == METADATA or _PART.match(name))) or not (
            isinstance(seal, str) and _HEX.match(seal)
        ):
            raise ValueError(f"{COMMIT} names a file {name!r:.40} that is not a part of a checkpoint")
    schema.shapes(record.get("model_shapes"))
    return record


def check_files(folder: Path, record: dict[str, Any]) -> None:
    """Every file the commit names is in ``folder`` with its seal; ValueError naming the first that is not."""
    for name, seal in record["files"].items():
        path = folder / name
        if not path.is_file() or path.is_symlink():
            raise ValueError(f"{name} is missing")
        if file_seal(path) != seal:
            raise ValueError(f"{name}: content digest mismatch (corrupted data)")


def check_index(folder: Path, record: dict[str, Any]) -> None:
    """DCP's index agrees with the commit: every model tensor and every optimizer state tensor the commit
    records is in it at its recorded size. ValueError otherwise (shards of another checkpoint or model)."""
    metadata = dcp_safe.read_metadata(folder / METADATA).state_dict_metadata
    want = {f"model.{k}": shape for k, shape in schema.shapes(record["model_shapes"]).items()}
    layout = record.get("optimizer_layout")
    if isinstance(layout, dict) and isinstance(layout.get("state"), dict):
        for param, entry in layout["state"].items():
            for name, shape in (entry or {}).items():
                if shape is not None and len(shape) > 0:
                    want[f"optim.state.{param}.{name}"] = tuple(shape)
    for key, shape in want.items():
        got = metadata.get(key)
        size = getattr(got, "size", None)
        if size is None:
            raise ValueError(f"its shards hold no {key!r:.60} (shards of another checkpoint?)")
        if tuple(size) != tuple(shape):
            raise ValueError(f"its shards hold {key!r:.60} of shape {list(size)}, its commit says {list(shape)}")


def model_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """The full (unsharded) shape of every tensor of the model's state dict: what ``same_model`` checks."""
    return {k: list(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def optimizer_layout(optimizer: Any, osd: dict[str, Any]) -> dict[str, Any]:
    """What ``fit`` compares before a resume: per group the parameters (by name, as ``get_state_dict``
    keys them) and hyperparameter names; per parameter each state entry's full shape (None: a value)."""
    groups = [
        {"params": list(group["params"]), "keys": sorted(set(live) - {"params"})}
        for group, live in zip(osd["param_groups"], optimizer.param_groups)
    ]
    state = {
        str(param): {
            str(name): (list(value.shape) if isinstance(value, torch.Tensor) else None) for name, value in entry.items()
        }
        for param, entry in osd["state"].items()
    }
    return {"groups": groups, "state": state}


def finite(model: torch.nn.Module, world_size: int, group: Any) -> bool:
    """Whether every rank's shards of the weights are finite: one host sync, agreed over the ranks through
    ``group``, the host group (the flag is a host number by then; NCCL's group carries no host tensor)."""
    from ddp_slurm.train.step import all_finite

    flag = torch.tensor([float(all_finite(p.to_local() for p in model.parameters() if p.is_floating_point()))])
    if world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
