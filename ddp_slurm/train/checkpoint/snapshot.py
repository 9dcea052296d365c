"""Host-memory snapshots of a training state, for checkpoints written in the background (wholefile_writer.py).

A snapshot copies every tensor of a nested state (dicts, lists, tuples) into host buffers that the
``Snapshotter`` owns and reuses while the layout stays the same (allocating and first-touching
gigabytes, pinned ones above all, costs more than copying into them); GPU tensors go to pinned
buffers, so the copy is a DMA queued on the tensor's stream behind the step that produced it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ddp_slurm.train.checkpoint import wholefile as checkpoint


def state_bytes(state: Any) -> int:
    """Bytes of every tensor in ``state`` (nested dicts, lists, tuples); of a DTensor, this rank's shard."""
    local = [t.to_local() if hasattr(t, "to_local") else t for _, t in checkpoint._tensors(state)]
    return sum(t.numel() * t.element_size() for t in local)


class Snapshotter:
    """Copies a nested state into host buffers it owns and reuses while the layout stays the same."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        self._buffers.clear()

    def copy(self, state: dict[str, Any]) -> tuple[dict[str, Any], list[torch.cuda.Event]]:
        """A copy of ``state`` whose tensors live in this snapshotter's host buffers, and the CUDA
        events the writer must wait for (GPU copies are queued, not finished, when this returns)."""
        events: list[torch.cuda.Event] = []
        seen: set[str] = set()
        snap = self._copy(state, "", events, seen)
        for stale in set(self._buffers) - seen:  # a layout that changed: do not keep both copies
            del self._buffers[stale]
        return snap, events

    def _copy(self, obj: Any, path: str, events: list[torch.cuda.Event], seen: set[str]) -> Any:
        if isinstance(obj, torch.Tensor):
            seen.add(path)
            return self._tensor(obj.detach(), path, events)
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v, f"{path}/{k}", events, seen)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self._copy(v, f"{path}/{i}", events, seen) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._copy(v, f"{path}/{i}", events, seen) for i, v in enumerate(obj))
        return copy.deepcopy(obj)  # plain values the loop may change after save() returns

    def _tensor(self, t: torch.Tensor, path: str, events: list[torch.cuda.Event]) -> torch.Tensor:
        buf = self._buffers.get(path)
        cuda = t.device.type == "cuda"
        # The copy keeps the tensor's strides (a channels_last weight stays channels_last): a resumed
        # optimizer takes its state tensors as loaded, and a fused kernel walking a parameter and its
        # moment buffers as flat memory needs them in the same layout, or it mixes up their elements.
        if (
            buf is None
            or buf.shape != t.shape
            or buf.stride() != t.stride()
            or buf.dtype != t.dtype
            or buf.is_pinned() != cuda
        ):
            # pinned host memory only for GPU tensors: pinning pageable CPU memory buys nothing;
            # empty_like keeps a dense tensor's strides (preserve_format)
            buf = torch.empty_like(t, device="cpu", pin_memory=cuda)
            self._buffers[path] = buf
        if cuda:
            buf.copy_(t, non_blocking=True)  # queued on the current stream, behind the step that made t
            event = torch.cuda.Event()
            event.record()
            events.append(event)
        else:
            buf.copy_(t)
        return buf


def on_gpu(state: Any) -> bool:
    """Whether any tensor of ``state`` lives on a GPU (a forked writer cannot read those)."""
    return any(t.device.type != "cpu" for _, t in checkpoint._tensors(state))
