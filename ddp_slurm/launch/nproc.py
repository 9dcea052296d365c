"""``python -m ddp_slurm.launch.nproc``: how many training processes a torchrun agent starts on its node.

sbatch/mnist_torchrun.sh asks this once per job and prints ``N (where N came from)``. One process per
GPU of the node, read from the first of: ``DDP_SLURM_NPROC_PER_NODE`` (the user's word),
``SLURM_GPUS_ON_NODE`` (what Slurm gave the node), ``SLURM_GPUS_PER_NODE`` (``--gpus-per-node``, maybe
typed: ``a100:4``), the GPU list of the job (``SLURM_JOB_GPUS``, ``CUDA_VISIBLE_DEVICES``). A job that
asked for GPUs in a way none of these counts per node (``--gpus=8`` over several nodes,
``--gpus-per-task``) is refused with the fix, instead of silently starting one process per node and
leaving GPUs idle; a job that asked for no GPU at all is a CPU job: one process per node, said so.
No torch import: it runs in the batch script before any training.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ddp_slurm import errors

# Variables that show a GPU request Slurm does not translate into a per-node count by itself.
GPU_REQUESTS = ("SLURM_GPUS", "SLURM_GPUS_PER_TASK", "SLURM_TRES_PER_TASK", "SLURM_TRES_PER_NODE", "SLURM_TRES_PER_JOB")


class NprocError(errors.UsageError, ValueError):
    """The number of processes per node cannot be told; the message (one line) says how to fix it (exit 2)."""


def _count(value: str) -> int | None:
    """``4``, ``a100:4``, ``gpu:a100:4`` or ``a100:2,v100:2`` -> GPUs; None when it is not a count."""
    total = 0
    for part in value.split(","):
        last = part.strip().rpartition(":")[2]
        if not last.isdigit():
            return None
        total += int(last)
    return total or None


def _listed(value: str) -> int | None:
    """``0,1,2,3`` (a device list) -> 4; None for an empty or ``NoDevFiles`` list."""
    items = [v for v in value.split(",") if v.strip()]
    return len(items) if items and "NoDevFiles" not in value else None


def procs_per_node(environ: Mapping[str, str]) -> tuple[int, str]:
    """``(processes per node, where that came from)``; raises :class:`NprocError`."""
    own = environ.get("DDP_SLURM_NPROC_PER_NODE", "").strip()
    if own:
        if not own.isdigit() or int(own) < 1:
            raise NprocError(
                f"DDP_SLURM_NPROC_PER_NODE={own!r} is not a positive integer: set it to the processes per node"
            )
        return int(own), "DDP_SLURM_NPROC_PER_NODE"
    for name, parse in (
        ("SLURM_GPUS_ON_NODE", _count),
        ("SLURM_GPUS_PER_NODE", _count),
        ("SLURM_JOB_GPUS", _listed),
        ("CUDA_VISIBLE_DEVICES", _listed),
    ):
        value = environ.get(name, "").strip()
        found = parse(value) if value else None
        if found:
            return found, f"one per GPU: {name}={value}"
    asked = [
        f"{name}={environ[name]}"
        for name in GPU_REQUESTS
        if environ.get(name, "").strip() and ("GPUS" in name or "gpu" in environ[name])  # TRES: gres/gpu:2
    ]
    if asked:
        raise NprocError(
            f"the job asked for GPUs ({', '.join(asked)}) but Slurm gave no per-node count (SLURM_GPUS_ON_NODE, "
            "SLURM_GPUS_PER_NODE and CUDA_VISIBLE_DEVICES are unset): submit with --gpus-per-node=N, or set "
            "DDP_SLURM_NPROC_PER_NODE=N"
        )
    return 1, "no GPUs in this job: one CPU process per node (DDP_SLURM_NPROC_PER_NODE=N for more)"


def main(environ: Mapping[str, str] | None = None) -> int:
    try:
        count, source = procs_per_node(os.environ if environ is None else environ)
    except NprocError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"{count} {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
