"""``srun python -m ddp_slurm.doctor``: preflight of an allocation before a long job starts.

Every rank describes where it is (host, ranks, launcher, device, rendezvous address, the network
interface and address it will use, whether its host name resolves to loopback, visible GPUs), joins
the process group with a short timeout, checks one all-reduce and times all-reduce latency and
bandwidth, then probes for a slow node or link (``tools/probes.py``: compute and ring-neighbour transfers,
judged against the median of the others). Rank 0 prints a table (a row per rank) and a verdict
(``tools/doctor_table.py``: the rows side by side). A group that never formed cannot be gathered, so each
rank also diagnoses its own failure and prints a one-line verdict itself.
Every wait is bounded: a PhaseDeadline ends a rank that is stuck past its deadline, with a verdict.

Exit status: 0 OK, 1 something is wrong (the FAIL lines say what), 2 usage error.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from ddp_slurm import argtypes, safefs
from ddp_slurm.distributed import group
from ddp_slurm.distributed.env import BootstrapError, DistEnv, RendezvousError
from ddp_slurm.distributed.groups import Groups
from ddp_slurm.exitcodes import EXIT_FAILURE as EXIT_FAIL
from ddp_slurm.exitcodes import EXIT_OK, exit_now
from ddp_slurm.slurmjob import badnodes
from ddp_slurm.tools.doctor_table import cross_checks, fail_line, summary, table
from ddp_slurm.tools.preflight import (
    Failure,
    Report,
    describe,
    local_checks,
    rendezvous_failure,
    resolve_host,
    stuck_rendezvous,
)
from ddp_slurm.train import logs


class PhaseDeadline:
    """Ends this process with a verdict when a phase outlives its deadline: the doctor never hangs."""

    def __init__(self, say) -> None:
        self._say = say
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def arm(self, seconds: float, on_expiry, code: int = EXIT_FAIL) -> None:
        """In ``seconds`` print ``on_expiry()`` and exit with ``code``, unless disarmed first."""
        self.disarm()
        timer = threading.Timer(seconds, self._fire, args=(on_expiry, code))
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()

    def disarm(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None

    def _fire(self, on_expiry, code: int) -> None:
        self._say(on_expiry())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # a thread stuck in C++ cannot be interrupted any other way


def measure(
    device: Any, rank: int, world_size: int, size_mb: float, iters: int, phase, group: Any = None
) -> dict[str, Any]:
    """One all-reduce checked for correctness, then median latency (4 bytes) and bus bandwidth, over
    ``group`` (the training group: training's gradients take this path)."""
    import torch
    import torch.distributed as dist

    def timed(tensor: torch.Tensor, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with phase("the all-reduce check"):
        values = torch.arange(4096, dtype=torch.float32, device=device) + rank
        dist.all_reduce(values, group=group)
        expected = torch.arange(4096, dtype=torch.float32) * world_size + world_size * (world_size - 1) / 2
        correct = bool(torch.equal(values.cpu(), expected))
    with phase("the latency test"):
        small = torch.zeros(1, device=device)
        timed(small, 3)  # warm-up: the first collectives set up connections and buffers
        latency_s = timed(small, 20)
    with phase("the bandwidth test"):
        big = torch.ones(max(1, int(size_mb * 2**20) // 4), device=device)
        timed(big, 1)
        seconds = timed(big, iters)
    # Bus bandwidth (as nccl-tests reports it): what each link carries in a ring all-reduce.
    bus = big.numel() * 4 * 2 * (world_size - 1) / world_size / seconds if world_size > 1 else None
    return {
        "correct": correct,
        "latency_ms": 1e3 * latency_s,
        "bus_gbps": bus / 1e9 if bus else None,
        "bandwidth_s": seconds,
    }


MAX_ITERS = 1000  # timed repeats of the bandwidth test


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """A bad flag is one line (exit 2) here, before any rendezvous: a nan or inf timeout would otherwise
    reach the rendezvous and the collectives and be reported as their failure."""
    size_limit, size_why = argtypes.memory_mib()
    parser = argtypes.OneLineParser(
        prog="python -m ddp_slurm.doctor",
        description=(
            "Preflight of a distributed allocation: run it the way the training will run "
            "(srun, torchrun or one process). Exit 0 only when everything is OK."
        ),
    )
    parser.add_argument(
        "--timeout",
        type=argtypes.number(0, argtypes.MAX_TIMEOUT_S, "seconds", above=True),
        default=30.0,
        metavar="S",
        help="seconds the rendezvous and each collective may take (default 30)",
    )
    parser.add_argument(
        "--size-mb",
        type=argtypes.number(0, size_limit, size_why, above=True),
        default=64.0,
        metavar="MIB",
        help="message size of the bandwidth test in MiB (default 64)",
    )
    parser.add_argument(
        "--iters",
        type=argtypes.integer(1, MAX_ITERS),
        default=5,
        help="timed repeats of the bandwidth test (default 5)",
    )
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument(
        "--link-mb",
        type=argtypes.number(0, size_limit, size_why, above=True),
        default=8.0,
        metavar="MIB",
        help="message size of the link probe (each rank to its ring neighbours) in MiB (default 8)",
    )
    parser.add_argument(
        "--slow-factor",
        type=argtypes.number(1, 1000, "times the median", above=True),
        default=3.0,
        metavar="X",
        help="a node or link more than X times slower than the median of the others is named (default 3)",
    )
    parser.add_argument(
        "--exclude-slow",
        type=argtypes.run_dir,
        metavar="RUN_DIR",
        help="record the nodes named slow in RUN_DIR/slow_nodes, which the run's launchers leave out "
        "with slurm.exclude_slow=true",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # torch's C++ store retries and stack dumps would bury the one line that says what is wrong.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

    def say(line: str) -> None:
        print(line, flush=True)

    host = socket.gethostname()
    try:
        env = DistEnv.from_environ(os.environ)
    except BootstrapError as exc:
        mismatch = any(word in str(exc) for word in ("must be smaller", "disagrees", "cannot hold more"))
        rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "?"
        say(
            fail_line(
                f"rank {rank} on {host}",
                Failure("mismatched world size" if mismatch else "launcher environment", str(exc)),
            )
        )
        return EXIT_FAIL
    logs.setup(env.rank, host)
    if resolve_host(env.master_addr):  # an unresolvable name is diagnosed by the rendezvous below
        group.fix_loopback_ifname(env, os.environ)
    rep = describe(env, os.environ)
    fails, suspects = local_checks(rep, os.environ)
    for failure in fails:
        say(fail_line(rep.where(), failure))
    if fails:
        return EXIT_FAIL
    # From here a thread may be left inside torch's C++ (a store connect past its deadline, a gloo
    # worker): interpreter finalization would abort the process under it and lose the verdict's exit
    # status (see exitcodes.exit_now), so the doctor leaves without finalizing.
    exit_now(_meet_and_measure(args, env, rep, suspects, say))


def _meet_and_measure(args: argparse.Namespace, env: DistEnv, rep: Report, suspects: list[str], say) -> int:
    deadline = PhaseDeadline(say)
    grace = max(10.0, args.timeout / 2)  # torch's own timeout fires first and names the cause better
    deadline.arm(args.timeout + grace, lambda: fail_line(rep.where(), stuck_rendezvous(rep, args.timeout + grace)))
    try:
        device, backend = group.init_distributed(env, args.backend, args.timeout)
    except (BootstrapError, RendezvousError) as exc:
        deadline.disarm()
        failure = (
            rendezvous_failure(exc, rep, args.timeout, suspects)
            if isinstance(exc, RendezvousError) or "cannot be resolved" in str(exc)
            else Failure("setup", str(exc))
        )
        say(fail_line(rep.where(), failure))
        return EXIT_FAIL
    finally:
        deadline.disarm()
    rep.device, rep.backend = str(device), backend
    try:
        code = _after_init(args, env, rep, device, deadline, say, grace)
    except Exception as exc:  # a collective failed: a peer died or timed out
        gist = logs.collective_failure(exc) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        failure = Failure("collective failed", f"{gist} (another rank probably failed: see its line)")
        say(fail_line(rep.where(), failure))
        code = EXIT_FAIL
    # Leaving the group must not hang either; the verdict is already out, so keep its exit status.
    deadline.arm(args.timeout + grace, lambda: f"doctor: {rep.where()}: leaving the process group hung", code)
    group.shutdown()
    deadline.disarm()
    return code


def _record_slow(run_dir: Any, hosts: list[str]) -> str:
    """``--exclude-slow RUN_DIR``: the slow hosts into the run's ``slow_nodes`` (the list requeue, the relaunch
    inside the allocation and submit leave out with ``slurm.exclude_slow=true``)."""
    named = [h for h in hosts if badnodes.HOST.fullmatch(h)]  # what record() writes: it drops the others
    left = sorted(set(hosts) - set(named))
    dropped = f" (not recorded, not Slurm host names: {', '.join(left)})" if left else ""
    if not named:
        return f"doctor: no slow node to record in {run_dir}{dropped}"
    try:
        badnodes.record(run_dir, named, os.environ.get("SLURM_JOB_ID"), "doctor", "named slow by doctor", slow=True)
    except (OSError, safefs.UnsafePath) as exc:
        return f"doctor: FAIL cannot record the slow nodes in {run_dir}: {exc}"
    return (
        f"doctor: recorded {', '.join(named)} in {run_dir}/slow_nodes{dropped}: with slurm.exclude_slow=true the "
        "run's submit, requeue and relaunch leave them out"
    )


def _after_init(
    args: argparse.Namespace, env: DistEnv, rep: Report, device: Any, deadline: PhaseDeadline, say, grace: float
) -> int:
    import contextlib

    import torch.distributed as dist

    from ddp_slurm.tools import probes  # torch, through the slow-rank rule: not for --help

    @contextlib.contextmanager
    def phase(what: str) -> Iterator[None]:
        # gloo raises when a collective outlives --timeout, and that error names the cause best; NCCL's own
        # watchdog instead kills the process at --timeout, before any verdict: there the doctor's comes first.
        limit = 0.8 * args.timeout if rep.backend == "nccl" else args.timeout + grace
        deadline.arm(
            limit,
            lambda: fail_line(
                rep.where(),
                Failure(
                    "collective stuck",
                    f"{what} did not finish within {limit:.0f} s: a rank stopped answering "
                    "(see the other ranks' lines)",
                ),
            ),
        )
        try:
            yield
        finally:
            deadline.disarm()

    with phase("making the host group"):
        groups = Groups.make(device)
    row = {**asdict(rep), **measure(device, env.rank, env.world_size, args.size_mb, args.iters, phase, groups.train)}
    with phase("waiting for the other ranks before the compute probe"):
        dist.barrier(group=groups.host)  # every rank computes at the same moment: they share what they share
    row["compute_s"] = probes.compute_seconds(device, phase)
    row["links"] = probes.ring_seconds(device, env.rank, env.world_size, args.link_mb, phase, groups.train)
    rows: list[Any] = [None] * env.world_size
    with phase("gathering the reports"):
        dist.all_gather_object(rows, row, group=groups.host)
    verdict = [EXIT_OK]
    if env.rank == 0:
        problems = cross_checks(rows)
        slow = probes.judge(rows, args.slow_factor, args.link_mb)
        problems += [(where, Failure("slow", why)) for where, why in slow]
        if args.exclude_slow is not None:
            say(_record_slow(args.exclude_slow, [where for where, _ in slow if not where.startswith("link ")]))
        say(f"doctor: {summary(rows, args.size_mb)}\n{table(rows)}")
        if problems:
            say(f"doctor: verdict FAIL ({len(problems)} problem(s)):")
            for where, failure in problems:
                say(fail_line(where, failure))
            verdict[0] = EXIT_FAIL
        else:
            say("doctor: verdict OK")
    with phase("sharing the verdict"):
        dist.broadcast_object_list(verdict, src=0, group=groups.host)
    return int(verdict[0])


if __name__ == "__main__":
    sys.exit(main())
