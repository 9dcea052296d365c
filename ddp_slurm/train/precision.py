"""``train.precision``: refuse a precision the device or the strategy cannot run, before any work starts,
and the gradient scaler that ``fp16`` trains with.

On CPU both mixed precisions run under torch's CPU autocast (as Lightning's ``bf16-mixed`` does on CPU):
not for speed (CPU autocast is usually no faster than fp32), but so that the code a GPU cluster runs (the
bf16 FSDP2 policy, fp16's gradient scaler and its checkpointed state) is the code the CPU suite runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddp_slurm import errors
from ddp_slurm.config import ConfigError
from ddp_slurm.train.syncmode import ENV as SYNC_DEBUG

log = logging.getLogger("ddp_slurm")

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores


def check_precision(precision: str, device: torch.device, strategy: Any = None) -> None:
    """Raise :class:`ConfigError` (one line, the fix included) if ``device`` cannot train in ``precision``.

    ``bf16`` on a GPU needs compute capability 8.0 or newer: older ones (V100, T4, P100) have no bf16
    tensor cores, so torch either refuses the kernels or emulates them many times slower than fp32; they
    have fp16 ones. ``fp16`` needs a strategy whose gradient scaler every rank agrees on (``strategy``:
    the run's ``Strategy``; its ``scales_fp16``). On CPU both are accepted, with one warning on rank 0:
    they exist there to test the GPU path and its memory, not to train faster.
    """
    if precision == "fp32":
        return
    if precision == "fp16" and strategy is not None and not strategy.scales_fp16:
        raise ConfigError(
            f"train.precision=fp16 runs under dist.strategy=ddp, not {strategy.name} (FSDP2 has no gradient scaler "
            "that keeps every rank's skipped steps in agreement here): use train.precision=bf16"
        )
    if device.type == "cpu":
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning(
                "train.precision=%s on CPU: torch's CPU autocast, for testing the GPU path and its memory; "
                "usually no faster than train.precision=fp32%s",
                precision,
                " (fp16 convolutions: many times slower)" if precision == "fp16" else "",
            )
        return
    if device.type != "cuda":
        raise ConfigError(
            f"train.precision={precision} runs on a CUDA GPU or the CPU, and this rank runs on {device}: "
            "use train.precision=fp32"
        )
    if precision != "bf16":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < BF16_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"train.precision=bf16 needs a GPU of compute capability {BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]} "
            f"or newer (A100, H100, RTX 30xx and later); {device} is a {name} ({capability[0]}.{capability[1]}): "
            "use train.precision=fp16 (fp16 tensor cores, with a gradient scaler) or train.precision=fp32"
        )


def make_scaler(
    precision: str,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None = None,
    environ: Mapping[str, str] = os.environ,
) -> torch.amp.GradScaler | None:
    """``fp16``'s gradient scaler (torch's defaults: scale 2**16, halved on a step with inf/NaN gradients,
    which is skipped, doubled after 2000 steps without); None for the other precisions. Its state is in
    every checkpoint (``checkpoint/state.py``).

    With ``optimizer`` (the run's), refuse (UsageError, exit 2) the one combination whose every step waits
    for the device under ``DDP_SLURM_SYNC_DEBUG=error``: see ``check_scaler_sync``."""
    if precision != "fp16":
        return None
    if optimizer is not None:
        check_scaler_sync(optimizer, environ)
    return torch.amp.GradScaler(device.type)


def check_scaler_sync(optimizer: torch.optim.Optimizer, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse fp16's scaler with an optimizer that cannot take it on the device, under ``DDP_SLURM_SYNC_DEBUG=error``.

    A fused optimizer (``_step_supports_amp_scaling``: torch's fused Adam, AdamW, SGD) receives the scale
    and the inf flag as device tensors and skips an overflowing step inside its kernel; for any other,
    ``GradScaler.step`` reads the flag with ``.item()`` to decide on the host: one host sync per step,
    which the sync-debug watch turns into a traceback on the first steady step. Refused on CPU too,
    where nothing is watched, so that CI meets the refusal a GPU run would. (No way around the sync
    exists short of stepping unconditionally and undoing the step, which is no longer the same arithmetic.)
    """
    if environ.get(SYNC_DEBUG) != "error" or getattr(optimizer, "_step_supports_amp_scaling", False):
        return
    raise errors.UsageError(
        f"train.precision=fp16 with an optimizer that is not fused ({type(optimizer).__name__}) reads the gradient scaler's "
        f"inf flag on the host every step, which {SYNC_DEBUG}=error refuses: use a fused optimizer (torch's Adam, "
        f"AdamW or SGD with fused=True, as the runtime's own where torch has them), train.precision=bf16, "
        f"or {SYNC_DEBUG}=warn"
    )
