"""``train.precision``: refuse a precision the device or the strategy cannot run, before any work starts,
and the gradient scaler that ``fp16`` trains with."""

from __future__ import annotations

from typing import Any

import torch

from ddp_slurm.config import ConfigError

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores


def check_precision(precision: str, device: torch.device, strategy: Any = None) -> None:
    """Raise :class:`ConfigError` (one line, the fix included) if ``device`` cannot train in ``precision``.

    ``bf16`` and ``fp16`` need CUDA (on CPU autocast to either is slower than fp32 for these models).
    ``bf16`` also needs a GPU of compute capability 8.0 or newer: older ones (V100, T4, P100) have no bf16
    tensor cores, so torch either refuses the kernels or emulates them many times slower than fp32; they
    have fp16 ones. ``fp16`` needs a strategy whose gradient scaler every rank agrees on (``strategy``:
    the run's ``Strategy``; its ``scales_fp16``).
    """
    if precision == "fp32":
        return
    if precision == "fp16" and strategy is not None and not strategy.scales_fp16:
        raise ConfigError(
            f"train.precision=fp16 runs under dist.strategy=ddp, not {strategy.name} (FSDP2 has no gradient scaler "
            "that keeps every rank's skipped steps in agreement here): use train.precision=bf16"
        )
    if device.type != "cuda":
        raise ConfigError(
            f"train.precision={precision} needs a CUDA GPU, and this rank runs on {device}: use train.precision=fp32"
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


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """``fp16``'s gradient scaler (torch's defaults: scale 2**16, halved on a step with inf/NaN gradients,
    which is skipped, doubled after 2000 steps without); None for the other precisions. Its state is in
    every checkpoint (``checkpoint/state.py``)."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
