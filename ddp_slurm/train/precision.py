"""``train.precision``: refuse a precision the device cannot run fast, before any work starts."""

from __future__ import annotations

import torch

from ddp_slurm.config import ConfigError

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores


def check_precision(precision: str, device: torch.device) -> None:
    """Raise :class:`ConfigError` (one line, the fix included) if ``device`` cannot train in ``precision``.

    ``bf16`` needs CUDA (on CPU autocast to bf16 is slower than fp32 for these models) and a GPU of
    compute capability 8.0 or newer: older ones (V100, T4, P100) have no bf16 tensor cores, so torch
    either refuses the kernels or emulates them many times slower than fp32.
    """
    if precision != "bf16":
        return
    if device.type != "cuda":
        raise ConfigError(
            f"train.precision=bf16 needs a CUDA GPU, and this rank runs on {device}: use train.precision=fp32"
        )
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < BF16_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"train.precision=bf16 needs a GPU of compute capability {BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]} "
            f"or newer (A100, H100, RTX 30xx and later); {device} is a {name} ({capability[0]}.{capability[1]}): "
            "use train.precision=fp32"
        )
