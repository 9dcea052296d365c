"""What every bench subcommand shares: the machine's description, statistics, the table and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ddp_slurm import errors, safefs, text
from ddp_slurm.distributed.env import RENDEZVOUS_VARS, TORCHRUN_LAYOUT_VARS
from ddp_slurm.train.ddp import wrap_ddp
from ddp_slurm.train.optim import make_optimizer, make_scheduler


class BenchError(errors.UsageError):
    """A benchmark that cannot run as asked; the message says why and what to do (exit 2)."""


def cpu_model() -> str:
    """The CPU's marketing name where the OS says it (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    """CPUs this process may run on (cgroup/cpuset aware where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def load_average() -> float | None:
    """1-minute load average: other work on the machine is the main source of noise in these figures."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpus": usable_cpus(),
        "python": platform.python_version(),
        "load_average_1m": load_average(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when there is a GPU, else CPU; asking for ``cuda`` without one is a usage error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but torch sees no CUDA GPU: use --device cpu (or run on a GPU node)")
    return torch.device(name)


def set_threads(requested: int | None) -> int:
    """Intra-op threads: ``requested``, else what ``ddp_slurm.train`` would use for one process; and
    malloc kept from returning freed memory to the OS, as ``ddp_slurm.train`` does (see hostmem)."""
    from ddp_slurm import hostmem

    hostmem.keep_freed_memory(os.environ)
    if requested is not None:
        torch.set_num_threads(requested)
        return requested
    from ddp_slurm.distributed.env import DistEnv
    from ddp_slurm.distributed.group import configure_threads

    return configure_threads(DistEnv.from_environ({}), os.environ)


def sync(device: torch.device) -> None:
    """Wait for queued device work: timings must cover the work, not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn`` takes, device work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median and spread (min, max, and max-min relative to the median) of repeated measurements."""
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / med if med else 0.0,
        "values": list(values),
    }


def scaled(s: Mapping[str, Any], factor: float) -> dict[str, Any]:
    """A summary in other units (the relative spread is unchanged)."""
    return {
        "median": s["median"] * factor,
        "min": s["min"] * factor,
        "max": s["max"] * factor,
        "spread": s["spread"],
        "values": [v * factor for v in s["values"]],
    }


def fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def fmt_spread(s: Mapping[str, Any], digits: int = 0) -> list[str]:
    """Table cells: median, min-max, relative spread."""
    return [fmt(s["median"], digits), f"{fmt(s['min'], digits)}-{fmt(s['max'], digits)}", f"{100 * s['spread']:.0f}%"]


def table(title: str, headers: Sequence[str], rows: Iterable[Sequence[str]], notes: Iterable[str] = ()) -> str:
    """A plain-text table: first column left-aligned, the figures right-aligned."""
    out = [title, *text.columns([list(map(str, headers)), *rows], numeric_from=1, rule=True)]
    out += [f"  {n}" for n in notes]
    return "\n".join(out)


def busy_note(payload: Mapping[str, Any]) -> str | None:
    """A warning when other work competes for the cores that several threads per process expect."""
    load, cpus = payload["machine"]["load_average_1m"], payload["machine"]["cpus"]
    if load is None or payload["threads"] <= 1 or load < cpus:
        return None
    return (
        f"  note: the machine is busy (load {load} on {cpus} CPUs) and each process runs {payload['threads']} "
        "threads: OpenMP threads that spin while a sibling waits for a core can slow small steps down 10x "
        "and more; compare with --threads 1"
    )


def report(payload: dict[str, Any], text: str, json_path: Path | None) -> None:
    """Print the table (and a note when the machine is busy); write the JSON (header + figures) where asked:
    whole or not at all, never through a symlink (its folder was checked before the benchmark ran:
    ``argtypes.output_file``)."""
    note = busy_note(payload)
    print(text if note is None else f"{text}\n{note}", flush=True)
    if json_path is not None:
        data = (json.dumps(payload, indent=2) + "\n").encode()
        safefs.write_atomic(json_path, lambda f: f.write(data))
        print(f"wrote {json_path}", file=sys.stderr)


def header(command: str, device: torch.device | str, threads: int, **params: Any) -> dict[str, Any]:
    """The part of every JSON file that says where and how it was measured."""
    return {
        "command": command,
        "machine": machine(),
        "torch": torch.__version__,
        "threads": threads,
        "device": str(device),
        "params": params,
    }


def child_env(**extra: str) -> dict[str, str]:
    """The environment for benchmark child processes: no launcher variables of the job this runs in,
    so a child started inside a Slurm step or torchrun does not take itself for one of its ranks."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_"))
        and k not in (*TORCHRUN_LAYOUT_VARS, *RENDEZVOUS_VARS)
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def mnist_trainer(model_name: str, global_batch: int, rank: int, world: int, device: torch.device, group: Any = None):
    """(model, step, step on the bare model, batches) built the way ``ddp_slurm.train`` builds them for
    the MNIST task on the bundled sample: the task's loss, the runtime's optimizer, schedule, DDP
    wrapper (over ``group``, the training group) and in-memory batches (an endless iterator over epochs)."""
    from ddp_slurm import config
    from ddp_slurm.tasks.mnist import MNIST
    from ddp_slurm.train import loader, step
    from ddp_slurm.train.task import Context

    cfg = config.load(overrides=[f"model.name={model_name}", f"train.global_batch_size={global_batch}"])
    task = MNIST(
        cfg.task_config, Context(rank, world, rank, device, cfg.run.seed, Path(cfg.run.output_root), global_batch)
    )
    batches = loader.InMemory(task.train_data(), device, cfg.run.seed, global_batch, rank, world)
    torch.manual_seed(cfg.run.seed)
    model = task.build_model().to(device)
    optimizer = make_optimizer(cfg.train, model.parameters(), device)
    scheduler = make_scheduler(cfg.train, optimizer, 10**9)  # its length does not change the cost
    net = wrap_ddp(model, device, world, settle=True, group=group)
    train_step = step.make_step(net, optimizer, scheduler, task.training_step, device, cfg.train.precision)
    # The same step on the module inside DDP: DDP's hooks stay idle when its forward is bypassed.
    bare = step.make_step(model, optimizer, scheduler, task.training_step, device, cfg.train.precision)

    def endless():
        epoch = 0
        while True:
            yield from batches.epoch(epoch, 0)
            epoch += 1

    return model, optimizer, train_step, bare, endless()


def run_local_ranks(
    what: str, world: int, threads: int, folder: Path, tag: str, timeout: float, command: Callable[[Path], list[str]]
) -> list[Path]:
    """Start ``world`` local ranks of ``command(out_path)`` as torchrun would (RANK, WORLD_SIZE, a free
    MASTER_PORT on 127.0.0.1), wait for all, and return their output files in rank order; a rank that
    fails or outlives ``timeout`` is BenchError naming it and the last lines of its log."""
    import subprocess

    from ddp_slurm.distributed.env import free_port

    port, procs, outs = free_port(), [], []
    for rank in range(world):
        out, log = folder / f"{tag}-r{rank}-{port}.json", folder / f"{tag}-r{rank}-{port}.log"
        env = child_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(threads),
        )
        with open(log, "w") as f:
            procs.append(subprocess.Popen(command(out), env=env, stdout=f, stderr=subprocess.STDOUT))
        outs.append((out, log))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [None] * world
    finally:
        for p in procs:  # only our own workers, by their process handles
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (code, (out, log)) in enumerate(zip(codes, outs)):
        if code != 0:
            tail = log.read_text().strip().splitlines()[-5:]
            why = f"exit {code}" if code is not None else f"no result after {timeout:g} s"
            raise BenchError(f"{what} worker rank {rank}/{world} failed ({why}): {' | '.join(tail)}")
    return [out for out, _ in outs]
