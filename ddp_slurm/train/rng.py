"""Save and put back this process's random streams around work that must not consume them.

Two callers, one home: the CUDA graph's warm-up steps (``graphs.py``: every stream, CUDA's too)
and a Dataset's item in the training process (``loader.py``: host streams only, since it runs per
sample and reading every GPU's generator costs a device sync). What a checkpoint stores of the
streams, per rank, is ``state.rng_state``.
"""

from __future__ import annotations

import random
from typing import Any

import torch


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
