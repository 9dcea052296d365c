"""The bounds of the bench's flags: each subcommand's numbers are checked types (ddp_slurm/argtypes.py)
bounded by what this machine can run (processes and threads per CPU) and hold (available memory), so a
benchmark refuses in one line, before it starts, what would not end or not fit (exit 2)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ddp_slurm import argtypes
from ddp_slurm.bench import common

# Bounds of the flags (argtypes): a benchmark refuses, before it starts, what would not end or not fit.
MAX_REPEATS = 1000  # repeats, rounds, windows, pairs, seeds: each one a measurement or a whole run
MAX_STEPS = 1_000_000  # steps (and warm-up steps) of one window or run
PER_CPU = 4  # local ranks, threads or worker processes per CPU this process may use


def _per_cpu() -> tuple[int, str]:
    cpus = common.usable_cpus()
    return PER_CPU * cpus, f"{PER_CPU} x the {cpus} CPUs this process may use"


def per_cpu(low: int = 1) -> Callable[[str], int]:
    """The type of a flag that starts processes or threads: ``low`` to ``PER_CPU`` x the usable CPUs."""
    return argtypes.integer(low, *_per_cpu())


def world_sizes() -> Callable[[str], list[int]]:
    """The type of a comma-separated list of local world sizes (each bounded as ``per_cpu``)."""
    return argtypes.integers(1, *_per_cpu())


def count(low: int = 1) -> Callable[[str], int]:
    return argtypes.integer(low, MAX_REPEATS)


def steps(low: int = 1) -> Callable[[str], int]:
    return argtypes.integer(low, MAX_STEPS)


def batch(ranks: int = 1) -> Callable[[str], int]:
    """Per-rank batch of ``ranks`` ranks drawing from the bundled sample."""
    from ddp_slurm.tasks.mnist.data import TRAIN_SIZES

    why = "the bundled sample's images" + (f" / {ranks} ranks" if ranks > 1 else "")
    return argtypes.integer(1, TRAIN_SIZES["sample"] // ranks, why)


def seconds() -> Callable[[str], float]:
    return argtypes.number(0, argtypes.MAX_TIMEOUT_S, "seconds", above=True)


def check_memory(what: str, need_bytes: float) -> None:
    """BenchError naming ``what`` (the flags and their values) when the benchmark would hold more than
    ``argtypes.MEMORY_SHARE`` of the host's available memory: refused before anything is allocated."""
    limit_mib, why = argtypes.memory_mib()
    if need_bytes / 2**20 > limit_mib:
        raise common.BenchError(
            f"{what}: needs about {need_bytes / 2**20:,.0f} MiB, more than {limit_mib:,.0f} MiB ({why}); "
            "choose smaller sizes"
        )


def check_training_config(path: Path | None, overrides: Sequence[str]) -> None:
    """BenchError (the config's one line) unless ``python -m ddp_slurm.train`` would take this config file
    and these overrides: found before the benchmark starts its first training process."""
    from ddp_slurm import config

    try:
        config.load(path, overrides)
    except config.ConfigError as exc:
        raise common.BenchError(str(exc)) from None
