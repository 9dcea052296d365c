"""This process's random streams, in one place: what a checkpoint keeps of them per rank, fresh ones for
a rank, and saving and putting them back around work that must not consume them.

- ``rng_state`` / ``set_rng_state``: one rank's streams (python, numpy, torch's CPU, and this rank's own
  CUDA device) as a checkpoint stores them (tensors and plain values only: checkpoints load with
  ``weights_only``), and back;
- ``seed_rank``: fresh, distinct streams for a rank (the start of a run, or a rank that had no
  counterpart when a run resumes at another world size);
- ``capture`` / ``restore``: around the CUDA graph's warm-up steps (``graphs.py``: every stream, CUDA's
  too) and a Dataset's item in the training process (``loader.py``: host streams only, since it runs per
  sample and reading every GPU's generator costs a device sync).
"""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG streams; CUDA: only this rank's own device (another job may see more or fewer GPUs)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:  # as tensors and plain values: checkpoints load with weights_only (no numpy arrays in them)
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_rank(seed: int, rank: int, step: int, device: torch.device) -> None:
    """Fresh, distinct RNG streams for ``rank`` (start of a run, or a rank new at a resume)."""
    s = (seed * 1_000_003 + step) * 65_537 + rank
    random.seed(s)
    torch.manual_seed(s)  # seeds every CUDA device too
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(s & 0xFFFF_FFFF)


def capture(cuda: bool = False) -> tuple[Any, ...]:
    """Python's, torch's CPU and numpy's (when installed) streams, and with ``cuda`` every GPU's."""
    try:
        import numpy as np
    except ImportError:  # numpy is optional for tasks
        np_state = None
    else:
        np_state = np.random.get_state()
    gpus = torch.cuda.get_rng_state_all() if cuda else None
    return random.getstate(), torch.get_rng_state(), np_state, gpus


def restore(saved: tuple[Any, ...]) -> None:
    """Put back what ``capture`` returned."""
    py, cpu, np_state, gpus = saved
    random.setstate(py)
    torch.set_rng_state(cpu)
    if np_state is not None:
        import numpy as np

        np.random.set_state(np_state)
    if gpus is not None:
        torch.cuda.set_rng_state_all(gpus)
