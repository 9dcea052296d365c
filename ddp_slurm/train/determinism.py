"""``train.deterministic``: the settings under which a GPU run computes the same bits every time.

On CPU the package's runs are already bit-for-bit repeatable (one thread per rank, fixed reduction
order) and resume bit-identically; nothing here changes that. On a GPU, cuDNN picks convolution
algorithms by timing them (``benchmark``) and some kernels add in an order that depends on thread
scheduling (atomics in the backward of ``index_add``, ``scatter_add``, some convolutions), so two
launches of the same step can round differently. What this module switches on, and what exactly
is then guaranteed, is written in docs/determinism.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

import torch

log = logging.getLogger(__name__)

# cuBLAS reduces in an order that depends on how many workspaces its streams share; a fixed workspace
# layout (NVIDIA's documented values, ":4096:8" or ":16:8") makes it repeatable. Read when cuBLAS
# first starts in the process, so it must be in the environment before the first matrix product.
CUBLAS_WORKSPACE = ":4096:8"
CUBLAS_VALID = (":4096:8", ":16:8")


def apply(enabled: bool, device: torch.device, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Switch this process to deterministic kernels when ``enabled``; returns what was set (for the log).

    Sets ``torch.backends.cudnn.deterministic`` (and ``benchmark`` off), ``torch.use_deterministic_algorithms``
    (an op without a deterministic kernel then raises instead of silently varying) and, on CUDA, the
    cuBLAS workspace variable in ``environ`` (``os.environ`` by default; a user's valid value is kept).
    Off, nothing is touched: torch's defaults stay. Call once per process before the first forward.
    """
    if not enabled:
        return []
    environ = os.environ if environ is None else environ
    done = []
    if device.type == "cuda":
        if environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_VALID:
            environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        done.append(f"CUBLAS_WORKSPACE_CONFIG={environ['CUBLAS_WORKSPACE_CONFIG']}")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    done += ["cudnn.deterministic", "cudnn.benchmark off", "use_deterministic_algorithms"]
    log.info("train.deterministic: %s", ", ".join(done))
    return done
