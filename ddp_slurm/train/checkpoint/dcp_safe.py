"""Reading torch's distributed checkpoints (DCP) without running code a co-tenant could have written.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` and every non-tensor value (the
optimizer's hyperparameters) with ``torch.load(weights_only=False)``: a folder someone else could
write then runs their code on resume, in ``checkpoint.load_latest`` and, in a team run, as a teammate.
The seal does not help (anyone who can write the folder can recompute it), so trust comes from the
load path: here ``.metadata`` goes through an unpickler that builds only the classes DCP's index is
made of (``_Restricted``: its dataclasses, ``torch.Size``, dtypes, layouts, a path) and refuses
everything else, and non-tensor values load with ``weights_only=True`` like every other checkpoint
file of this program. Tensor data was already read with ``weights_only=True`` by DCP itself.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, from torch's own table
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


# What a DCP call raises when it fails: its CheckpointException derives from BaseException, not Exception.
FAILED = (Exception, CheckpointException)


class _Restricted(pickle.Unpickler):
    """An unpickler for DCP's ``.metadata``: the classes above, and torch dtypes by name; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def read_metadata(path: Path) -> Metadata:
    """A DCP ``.metadata`` file, unpickled by ``_Restricted``; ValueError when it is anything else."""
    try:
        with open(path, "rb") as f:
            metadata = _Restricted(f).load()
    except Exception as exc:
        raise ValueError(f"{path.name} unreadable ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"{path.name} is not a checkpoint index")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by ``read_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        metadata = read_metadata(Path(self._get_metadata_path(rank)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_value(value: io.BytesIO) -> Any:
    return torch.load(value, weights_only=True)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._nested_dict import set_element

        loaded = _load_value(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    """The planner that rebuilds a whole state dict from ``.metadata`` (one process), values read safely."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        SafeLoadPlanner.load_bytes(self, read_item, value)  # type: ignore[arg-type]


def load(state: dict[str, Any], folder: Path, process_group: Any = None) -> None:
    """``dcp.load`` of ``folder`` into ``state`` (in place, resharding as needed), read safely. A collective."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner(), process_group=process_group)


def load_whole(folder: Path) -> dict[str, Any]:
    """Every tensor and value of ``folder`` as one state on this process (no process group needed)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state_dict=state,
            storage_reader=SafeReader(str(folder)),
            process_group=None,
            no_dist=True,
            planner=_SafeEmptyPlanner(),
        )
    except FAILED as exc:
        raise ValueError(f"unreadable ({unwrap(exc)})") from None
    return state


def unwrap(exc: BaseException) -> str:
    """The first real reason inside DCP's ``CheckpointException`` (a rank's OSError: "No space left on
    device"), not its ``ranks:dict_keys([0])``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                return unwrap(inner)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"
