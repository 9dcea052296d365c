"""Ready-made ``decode`` functions for ``Shards``: what ``ddp-slurm data write task=...`` writes, read back."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch


def tensors(sample: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The tuple of tensors a task's sample was (members ``0.npy``, ``1.npy``, ...; no pickle is ever loaded)."""
    arrays = []
    n = 0
    while f"{n}.npy" in sample:
        arrays.append(torch.from_numpy(np.load(io.BytesIO(sample[f"{n}.npy"]), allow_pickle=False)))
        n += 1
    if not arrays:
        raise ValueError(f"sample {sample.get('__key__')!r} has no 0.npy member: not written from a task's tensors")
    return tuple(arrays)


def npy(value: Any) -> bytes:
    """One tensor (or array or number) as ``.npy`` bytes, the inverse of ``tensors``."""
    array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    buf = io.BytesIO()
    np.save(buf, np.array(array, order="C"), allow_pickle=False)  # ascontiguousarray would make 0-d 1-d
    return buf.getvalue()
