"""``bench overhead``'s op count: the ops one optimizer step dispatches, the runtime's against the bare loop's.

Time on a shared machine drifts; the number of ops a step dispatches does not. A dispatch mode
(``torch.utils._python_dispatch.TorchDispatchMode``) sees every aten op below autograd, and the c10d
collectives, on CPU exactly as a GPU would receive them: each op that is neither a view nor a profiler
mark is a kernel launch there (a launch-bound model is paced by their number). Each op is attributed to
the innermost ``ddp_slurm`` frame on the Python stack (``SOURCES``: the step itself, the stop vote, the
loss and norm windows, the guard's trace, the clock, the scaler, ...), and counted in a step only while the training
loop's position is inside the measured window: ``steps`` optimizer steps after the first log window,
so the log lines in between are counted (amortised) and start-up, the final save and the exit are not.

The counts run in worker processes on CPU (``CUDA_VISIBLE_DEVICES=``, gloo at world size 2), whatever
``--device`` the timing uses: a count is a property of the code, and a GPU would be taken by the
runtime. What only a GPU runs (CUDA events, pinned-memory copies) takes the same branches on CPU where
the code lets it (``vote.py``); the clock's CUDA events are not aten ops and are named in the notes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

if __name__ == "__main__":  # a worker counts on CPU (see above): no GPU before torch looks for one
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from ddp_slurm.bench import common  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1]  # ddp_slurm/
OPS_STEPS = 40  # measured steps: two log windows (train.log_every_steps=20), no checkpoint (every 100)
HOST_READS = ("aten._local_scalar_dense",)  # item(), float(), bool(): a device-to-host copy and a wait on a GPU
# (source, how to find it): the first rule matching a frame's file (and function), innermost frame first.
SOURCES = (
    ("scaler", "torch/amp/grad_scaler.py", ""),
    ("clip", "torch/nn/utils/clip_grad.py", ""),
    ("norm window", "ddp_slurm/train/accumulate.py", "NormWindow."),
    ("vote", "ddp_slurm/train/vote.py", ""),
    ("loss window", "ddp_slurm/train/window.py", ""),
    ("clock", "ddp_slurm/train/clock.py", ""),
    ("guard", "ddp_slurm/train/guard/", ""),
    ("data", "ddp_slurm/train/loader.py", ""),
    ("checkpoint", "ddp_slurm/train/checkpoint/", ""),
    ("step", "ddp_slurm/train/step.py", ""),
    ("step", "ddp_slurm/train/accumulate.py", ""),
    ("step", "ddp_slurm/train/optim.py", ""),  # the optimizer's step
    ("step", "ddp_slurm/tasks/", ""),
    ("step", "ddp_slurm/bench/workload.py", ""),  # the bare loop
    ("hooks", "ddp_slurm/train/hooks/", ""),
    ("loop", "ddp_slurm/train/loop.py", ""),
)


def _source(code: Any) -> str | None:
    """The source a frame's code belongs to, or None (torch's own Python, this module)."""
    path = code.co_filename.replace(os.sep, "/")
    for name, where, qualname in SOURCES:
        if where in path and code.co_qualname.startswith(qualname):
            return name
    if "/ddp_slurm/" in path and not path.endswith("bench/opcount.py"):
        return "other: " + path.rsplit("/ddp_slurm/", 1)[1].removesuffix(".py")
    return None


def _kind(func: Any) -> str:
    name = str(func)
    if name.startswith("c10d."):
        return "collectives"
    if name.startswith("profiler."):  # record_function's marks (torch's optimizers make two per step): no launch
        return "markers"
    if name.rsplit(".", 1)[0] in HOST_READS:
        return "host_reads"
    return "views" if func.is_view else "kernels"


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched under it by (source, kind). ``window`` (first, end): only those the
    training loop dispatches while its position is in [first, end): the tail of each step (after the
    position advanced: the vote, the hooks) and the head of the next (the step itself); None: every op."""

    def __init__(self, window: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.window = window
        self.counts: Counter[tuple[str, str]] = Counter()
        self._sources: dict[Any, str | None] = {}
        from ddp_slurm.train import loop

        self._loop = loop.loop.__code__

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        source, frame = None, sys._getframe(1)
        counted = self.window is None
        while frame is not None:
            code = frame.f_code
            if source is None:
                if code not in self._sources:
                    self._sources[code] = _source(code)
                source = self._sources[code]
            if code is self._loop:
                counted = self._in_window(frame)
                break
            frame = frame.f_back
        if counted:
            self.counts[(source or "unattributed", _kind(func))] += 1
        return func(*args, **(kwargs or {}))

    def _in_window(self, frame: FrameType) -> bool:
        assert self.window is not None
        pos = frame.f_locals.get("pos")
        # None: the loop renamed its position, and the counter must follow (tests/test_bench.py::test_overhead_smoke)
        if pos is None:
            raise RuntimeError("opcount: the training loop has no local 'pos' to read the step from")
        return self.window[0] <= pos.step < self.window[1]

    def per_step(self, steps: int) -> dict[str, Any]:
        """Per optimizer step: ops by kind, and launches (kernels, collectives, host reads) by source."""
        kinds: Counter[str] = Counter()
        sources: Counter[str] = Counter()
        for (source, kind), n in self.counts.items():
            kinds[kind] += n
            if kind not in ("views", "markers"):
                sources[source] += n
        per = lambda n: round(n / steps, 4)  # noqa: E731  (exact counts: no float noise in the figures)
        out: dict[str, Any] = {k: per(kinds[k]) for k in ("kernels", "views", "markers", "collectives", "host_reads")}
        out["ops"] = per(sum(kinds.values()))
        out["launches"] = per(kinds["kernels"] + kinds["collectives"] + kinds["host_reads"])
        out["by_source"] = {s: per(n) for s, n in sorted(sources.items(), key=lambda kv: -kv[1])}
        out["steps"] = steps
        return out


def count_runtime(
    model: str, batch: int, steps: int, root: Path, guard: bool = False, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """This rank's ops per step in ``ddp_slurm.run`` (the bench's task), ``steps`` after the first window;
    ``extra``: more overrides (``train.grad_clip=1.0``: the norm window's share)."""
    import ddp_slurm
    from ddp_slurm.bench import workload

    first = workload.LOG_EVERY
    os.environ["DDP_SLURM_BENCH_REPEATS"] = str(workload.repeats(first + steps, batch))
    overrides = [
        f"guard.rollbacks={3 if guard else 0}",
        f"model.name={model}",
        f"train.global_batch_size={batch}",
        f"train.max_steps={first + steps}",
        f"train.log_every_steps={first}",
        f"run.output_root={root}",
        f"run.name=opcount{'-guard' if guard else ''}{len(extra) or ''}",
        *extra,
    ]
    with OpCounter((first, first + steps)) as counter:
        code = ddp_slurm.run(workload.LongSample, overrides)
    if code != 0:
        raise common.BenchError(f"the counted ddp_slurm run exited {code}: {' '.join(overrides)}")
    return counter.per_step(steps)


def count_bare(model: str, batch: int, steps: int) -> dict[str, Any]:
    """The bare loop's ops per step (``workload.bare_loop``, its measured steps only)."""
    from ddp_slurm.bench import workload

    counter = OpCounter()
    repeats = workload.repeats(steps, batch)
    workload.bare_loop(model, batch, steps, repeats, torch.device("cpu"), measured=counter)
    return counter.per_step(steps)


def measure(model: str, batch: int, guard: bool, timeout: float = 600) -> dict[str, Any]:
    """Ops per step of the bare loop and of the runtime at world sizes 1 and 2 (and with the guard at 1)."""
    out: dict[str, Any] = {"steps": OPS_STEPS, "device": "cpu"}
    with tempfile.TemporaryDirectory(prefix="ddp_slurm-opcount-") as tmp:
        for world in (1, 2):

            def command(path: Path, world: int = world) -> list[str]:
                return [sys.executable, "-m", "ddp_slurm.bench.opcount", "--worker", "--out", str(path),
                        "--model", model, "--batch", str(batch // world), "--root", tmp,
                        *(["--guard"] if guard and world == 1 else [])]  # fmt: skip

            outs = common.run_local_ranks("opcount", world, 1, Path(tmp), f"w{world}", timeout, command)
            result = json.loads(outs[0].read_text())  # rank 0's (every rank runs the same code)
            out[f"world_{world}"] = result["runtime"]
            out.update({k: v for k, v in result.items() if k != "runtime"})
    return out


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_slurm.bench.opcount --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True, help="per-rank batch")
    p.add_argument("--guard", action="store_true")
    args = p.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    root = args.root / f"w{world}-r{rank}" if world > 1 else args.root / "w1"
    result: dict[str, Any] = {"runtime": count_runtime(args.model, args.batch * world, OPS_STEPS, root)}
    if world == 1:
        result["bare"] = count_bare(args.model, args.batch, OPS_STEPS)
        if args.guard:
            result["world_1_guard"] = count_runtime(args.model, args.batch, OPS_STEPS, root, guard=True)
    args.out.write_text(json.dumps(result))
    return 0


def render_rows(counts: dict[str, Any]) -> list[list[str]]:
    """Rows of the op-count table: kernels, collectives, host reads and views per step, and the extra
    kernels by source (what the runtime adds to the step the bare loop also runs)."""
    rows = []
    names = [
        ("bare PyTorch loop", "bare"),
        ("ddp_slurm, world 1", "world_1"),
        ("ddp_slurm + guard, world 1", "world_1_guard"),
        ("ddp_slurm, world 2", "world_2"),
    ]
    for label, key in names:
        if key not in counts:
            continue
        c = counts[key]
        extra = ", ".join(f"{s} {n:g}" for s, n in c["by_source"].items() if s not in ("step", "data")) or "-"
        rows.append(
            [label, f"{c['kernels']:g}", f"{c['collectives']:g}", f"{c['host_reads']:g}", f"{c['views']:g}", extra]
        )
    return rows


if __name__ == "__main__":
    if "--worker" not in sys.argv[1:]:
        sys.exit("this module is the worker of `python -m ddp_slurm.bench overhead`; run that instead")
    from ddp_slurm.exitcodes import exit_now

    exit_now(worker(sys.argv[1:]))
